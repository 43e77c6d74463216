"""flagos bench (being written)."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    raise NotImplementedError("flagos bench")


def bench(*args, **kwargs):
    raise NotImplementedError("flagos bench")
