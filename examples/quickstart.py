"""Quickstart: one device for every chip, and what fell back to the CPU.

    python examples/quickstart.py            # FLAGOS_DEVICE=cuda python examples/quickstart.py
"""
import torch

import flagos

print(flagos.activate())                      # "auto", or FLAGOS_DEVICE / flagos.activate("npu")
device = flagos.device()                      # flagos:0 (npu:0 in native mode)

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)

flagos.set_route("aten::gelu", "fallback")    # pretend the chip lacks GELU: it runs on the CPU
for step in range(3):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")

print(flagos.fallback_report())               # aten::gelu shows as fallback, 3 calls
print("memory allocated:", torch.flagos.memory_allocated() if hasattr(torch, "flagos") else "n/a")
