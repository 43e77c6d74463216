"""Build of the C extension flagos._C (metadata lives in pyproject.toml)."""
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

WARNINGS = ["-Wall", "-Wextra", "-Werror"]


def find_uthash():
    """Directory holding uthash.h, or exit with the way to get it."""
    candidates = [os.environ.get("FLAGOS_UTHASH_INCLUDE", "")]
    for var in ("CPATH", "C_INCLUDE_PATH"):
        candidates += os.environ.get(var, "").split(os.pathsep)
    candidates += ["/usr/include", "/usr/local/include", "/opt/homebrew/include"]
    for d in candidates:
        if d and os.path.isfile(os.path.join(d, "uthash.h")):
            return d
    sys.exit(
        "flagos build: uthash.h was not found.\n"
        "  Install it: on Debian/Ubuntu `apt-get update && apt-get install -y uthash-dev`,\n"
        "  on macOS `brew install uthash`; or point FLAGOS_UTHASH_INCLUDE at the folder "
        "holding uthash.h."
    )


def sanitizer_flags():
    """FLAGOS_SANITIZE=address or undefined builds the extension for the AddressSanitizer or
    UndefinedBehaviorSanitizer job (tests/sanitizers/run.sh)."""
    which = os.environ.get("FLAGOS_SANITIZE", "")
    if not which:
        return [], []
    common = ["-fno-omit-frame-pointer", "-O1", "-g"]
    if which == "address":
        return ["-fsanitize=address", *common], ["-fsanitize=address"]
    if which == "undefined":
        # Python's own CFLAGS carry -fwrapv, which defines signed overflow and so hides it from
        # the sanitizer; -fno-wrapv comes later on the command line and wins for our sources.
        return (["-fsanitize=undefined", "-fno-sanitize-recover=undefined", "-fno-wrapv", *common],
                ["-fsanitize=undefined"])
    sys.exit(f"flagos build: FLAGOS_SANITIZE={which!r} is not supported; use 'address' or "
             "'undefined'.")


san_compile, san_link = sanitizer_flags()

core = Extension(
    "flagos._C",
    sources=["csrc/module.c", "csrc/state.c", "csrc/router.c", "csrc/payload.c",
             "csrc/fallback.c", "csrc/staging.c", "csrc/callsite.c", "csrc/adapter_load.c",
             "csrc/adapter_checks.c",
             "csrc/adapter_memory.c", "csrc/adapter_streams.c", "csrc/adapter_kernels.c",
             "csrc/adapter_fast.c", "csrc/adapter_fallback.c", "csrc/guard.c"],
    include_dirs=["csrc", "csrc/include"] + [d for d in [find_uthash()] if d != "/usr/include"],
    # The units share flagos_* functions with each other; only PyInit__C leaves the library.
    extra_compile_args=["-std=c11", "-fvisibility=hidden", *WARNINGS, *san_compile],
    extra_link_args=san_link,
)

# Chip adapters are plain shared libraries loaded with dlopen, not Python modules: they are
# built like extensions but named libflagos_<chip>_adapter.so inside flagos/adapters/.
sim = Extension(
    "flagos.adapters.libflagos_sim_adapter",
    sources=["backends/sim/sim.c", "backends/sim/kernels.c"],
    include_dirs=["csrc/include", "backends/sim"] + [d for d in [find_uthash()] if d != "/usr/include"],
    extra_compile_args=["-std=c11", *WARNINGS, *san_compile],
    extra_link_args=["-lpthread", "-lm", *san_link],
)

class BuildExt(build_ext):
    def get_ext_filename(self, fullname):
        # Called with full and with last-component names; adapters keep their plain .so name.
        if fullname.rsplit(".", 1)[-1].startswith("libflagos_"):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext):
        if ext.name.rsplit(".", 1)[-1].startswith("libflagos_"):
            return ["flagos_adapter_get"]
        return super().get_export_symbols(ext)


setup(ext_modules=[core, sim], cmdclass={"build_ext": BuildExt})
