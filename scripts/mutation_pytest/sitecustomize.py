"""Imported by every Python process of a mutation run (scripts/mutation_common.py puts this
folder on PYTHONPATH). Does nothing unless MUTATION_COVERAGE_DIR is set: then, during the
coverage pass of scripts/mutation_coverage.py, the process measures which lines of the mutated
module it runs, under the test named by MUTATION_COVERAGE_CONTEXT (set by mutation_plugin.py for
the children a test starts), and writes them to a data file of its own when it exits.

A forked child (multiprocessing's fork start method, a test's own os.fork()) measures too: it
starts a measurement of its own under the test that forked it, and writes it when it leaves,
by os._exit as such children usually do, or by a normal exit."""
import os

_DATA_DIR = os.environ.get("MUTATION_COVERAGE_DIR")
if _DATA_DIR:
    import atexit

    import coverage

    def _start():
        cov = coverage.Coverage(data_file=os.path.join(_DATA_DIR, "coverage"), data_suffix=True,
                                include=[os.environ["MUTATION_COVERAGE_INCLUDE"]], config_file=False)
        cov.start()
        cov.switch_context(os.environ.get("MUTATION_COVERAGE_CONTEXT", ""))
        return cov

    _coverage = _start()

    def _save() -> None:
        _coverage.stop()
        _coverage.save()

    def _in_forked_child() -> None:
        # The copy of the parent's measurement is the parent's to write; the child writes its own
        # lines, under the context the parent was in (the test, which mutation_plugin.py keeps in
        # the environment), in a file named by its own pid.
        global _coverage
        _coverage.stop()
        _coverage = _start()
        leave = os._exit

        def _exit_saving(status):
            try:
                _save()
            finally:
                leave(status)

        os._exit = _exit_saving

    atexit.register(_save)
    os.register_at_fork(after_in_child=_in_forked_child)
