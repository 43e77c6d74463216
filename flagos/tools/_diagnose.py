"""flagos diagnose (being written)."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    raise NotImplementedError("flagos diagnose")


def diagnose(*args, **kwargs):
    raise NotImplementedError("flagos diagnose")
