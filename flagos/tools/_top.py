"""flagos top (being written)."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    raise NotImplementedError("flagos top")


def top(*args, **kwargs):
    raise NotImplementedError("flagos top")
