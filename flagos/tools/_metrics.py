"""flagos metrics (being written)."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    raise NotImplementedError("flagos metrics")


def metrics(*args, **kwargs):
    raise NotImplementedError("flagos metrics")
