"""The torch.backends entry point: FLAGOS_DEVICE activates flagos at `import torch`."""
from conftest import device_mode_only, run_python


@device_mode_only
def test_autoload_with_flagos_device():
    proc = run_python("""
        import torch
        print(torch.ones(2, device='flagos') + 1)
        print("FLAGOS" if "flagos" in __import__("sys").modules else "NO")
        # no backward can have run before `import torch`: training works, and info() says so
        x = torch.ones(2, device='flagos', requires_grad=True)
        (x * 3).sum().backward()
        import flagos
        print("BACKWARD", flagos.info()["backward"], x.grad.tolist())
    """, env={"FLAGOS_DEVICE": "cpu"})
    assert "tensor([2., 2.], device='flagos:0')" in proc.stdout
    assert "FLAGOS" in proc.stdout  # flagos was imported by the autoload itself
    assert "BACKWARD True [3.0, 3.0]" in proc.stdout


@device_mode_only
def test_import_flagos_first_with_flagos_device_set():
    proc = run_python("""
        import flagos
        info = flagos.activate()      # autoload already activated it: same chip, a no-op
        import torch
        print(info["chip"], torch.ones(1, device="flagos").device)
    """, env={"FLAGOS_DEVICE": "cpu"})
    assert "cpu flagos:0" in proc.stdout


@device_mode_only
def test_autoload_alias_variable():
    proc = run_python("""
        import torch
        print(torch.zeros(1, device='flagos').device)
    """, env={"FLAGOS_DEVICE_BACKEND": "auto"})
    assert "flagos:0" in proc.stdout


def test_without_flagos_device_autoload_changes_nothing():
    proc = run_python("""
        import torch
        print(torch._C._get_privateuse1_backend_name(), hasattr(torch, "flagos"))
        import flagos
        print(torch._C._get_privateuse1_backend_name(), hasattr(torch, "flagos"))
    """)
    assert proc.stdout.split() == ["privateuseone", "False", "privateuseone", "False"]


def test_bad_flagos_device_fails_import_torch_clearly():
    proc = run_python("import torch", env={"FLAGOS_DEVICE": "tpu"}, check=False)
    assert proc.returncode != 0
    assert "unknown chip 'tpu'" in proc.stderr
