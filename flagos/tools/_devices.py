"""flagos devices (being written)."""


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    raise NotImplementedError("flagos devices")


def devices(*args, **kwargs):
    raise NotImplementedError("flagos devices")
