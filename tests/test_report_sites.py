"""Call sites as the report shows them: relative to site-packages or the working directory."""
import os

from flagos.report._sites import short_site


def test_a_library_site_is_shown_from_site_packages():
    sep = os.sep
    site = sep.join(["", "opt", "venv", "lib", "python3.11", "site-packages", "diffusers", "models", "unet.py"])
    assert short_site(site + ":42") == sep.join(["diffusers", "models", "unet.py"]) + ":42"
    # a virtual environment inside another's site-packages: cut at the first one only
    nested = sep.join(["", "a", "site-packages", "env", "site-packages", "torch", "nn.py"])
    assert short_site(nested + ":7") == sep.join(["env", "site-packages", "torch", "nn.py"]) + ":7"


def test_a_program_site_is_shown_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert short_site(str(tmp_path / "train.py") + ":10") == "train.py:10"
    outside = os.path.join(os.path.dirname(str(tmp_path)), "elsewhere", "run.py")
    assert short_site(outside + ":3") == outside + ":3"   # above the working directory: as given


def test_no_site_is_a_dash():
    assert short_site(None) == "-" and short_site("") == "-"
