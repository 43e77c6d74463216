"""Where flagos meets PyTorch subsystems and libraries: torch.compile, errors inside backward(),
parameter swaps and offloading, and the Diffusers / accelerate / safetensors / huggingface_hub
patches. Each installs itself at activation."""
