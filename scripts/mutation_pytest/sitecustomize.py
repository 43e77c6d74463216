"""Imported by every Python process of a mutation run (scripts/mutation_common.py puts this
folder on PYTHONPATH). Does nothing unless MUTATION_COVERAGE_DIR is set: then, during the
coverage pass of scripts/mutation_coverage.py, the process measures which lines of the mutated
module it runs, under the test named by MUTATION_COVERAGE_CONTEXT (set by mutation_plugin.py for
the children a test starts), and writes them to a data file of its own when it exits."""
import os

_DATA_DIR = os.environ.get("MUTATION_COVERAGE_DIR")
if _DATA_DIR:
    import atexit

    import coverage

    _coverage = coverage.Coverage(data_file=os.path.join(_DATA_DIR, "coverage"), data_suffix=True,
                                  include=[os.environ["MUTATION_COVERAGE_INCLUDE"]], config_file=False)
    _coverage.start()
    _coverage.switch_context(os.environ.get("MUTATION_COVERAGE_CONTEXT", ""))

    def _save() -> None:
        _coverage.stop()
        _coverage.save()

    atexit.register(_save)
