"""Systematic mutation testing of the Python package with cosmic-ray: every module under flagos/
gets its mutants (operators, comparisons, constants, booleans, conditions, exception types,
loops, decorators), each run against the tests scripts/mutation_map.py names for that module.

Started by scripts/mutation_full.sh, which installs the pinned cosmic-ray and runs this file
under `nice`; see that script and docs/testing.md.

Per module, a cosmic-ray session (<work>/python/sessions/<module>.sqlite) holds the mutants and
their results, so an interrupted run continues where it stopped; `cr-report` and `cr-html`
read the same sessions. A session is made again (its results dropped) when its module's source
changed. Mutants are applied in place in a scratch copy of the checkout (<work>/tree-python, see
scripts/mutation_common.py), one at a time, and the module's selection runs against it with
a timeout of max(--min-timeout, --timeout-factor x the selection's unmutated time). Each mutant
runs first against the tests that reach its line (scripts/mutation_coverage.py), and only when
it survives them, against the whole selection.
"""
from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time
from pathlib import Path

try:
    from cosmic_ray.commands.init import init as cr_init
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult
except ImportError:
    sys.exit("cosmic-ray is not installed: run scripts/mutation_full.sh, which installs it")

import mutation_common as common
import mutation_coverage
import mutation_reach
from mutation_check import ROOT
from mutation_map import source_files

# One replacement per operator instead of cosmic-ray's every-operator-for-every-operator (which
# multiplies the mutants by 12 for little more information): the arithmetic inverse, the
# boundary shift and the negation of each comparison, dropping a unary operator. Every other
# cosmic-ray operator (AddNot, True/False, and/or, break/continue, exception types, numbers,
# decorators, zero-iteration loops) is kept whole. --operators all keeps everything.
_BINARY = "Add_Sub Sub_Add Mul_Div Div_Mul FloorDiv_Div Mod_Div Pow_Mul LShift_RShift RShift_LShift " \
          "BitAnd_BitOr BitOr_BitAnd BitXor_BitAnd"
_COMPARE = "Eq_NotEq NotEq_Eq Lt_LtE LtE_Lt Gt_GtE GtE_Gt Lt_GtE LtE_Gt Gt_LtE GtE_Lt Is_IsNot IsNot_Is"
_UNARY = "Delete_Not Delete_USub Delete_Invert"
REDUCED = ({f"core/ReplaceBinaryOperator_{o}" for o in _BINARY.split()} |
           {f"core/ReplaceComparisonOperator_{o}" for o in _COMPARE.split()} |
           {f"core/ReplaceUnaryOperator_{o}" for o in _UNARY.split()})
FAMILIES = ("core/ReplaceBinaryOperator_", "core/ReplaceComparisonOperator_", "core/ReplaceUnaryOperator_")


def operator_kept(name: str, operators: str) -> bool:
    return operators == "all" or not name.startswith(FAMILIES) or name in REDUCED


def session_paths(work: str, module: str) -> tuple[str, str]:
    base = os.path.join(work, "python", "sessions", module.replace("/", "__"))
    return base + ".sqlite", base + ".json"


def open_session(work: str, tree: str, module: str, operators: str) -> str:
    """The module's session, made anew when the module or the operator set changed."""
    db_path, meta_path = session_paths(work, module)
    os.makedirs(os.path.dirname(db_path), exist_ok=True)
    sha = common.file_sha(os.path.join(tree, module))
    meta = common.load_json(meta_path, {})
    if os.path.exists(db_path) and meta.get("sha256") == sha and meta.get("operators") == operators:
        return db_path
    if os.path.exists(db_path):
        print(f"{module}: source or operator set changed since its session; starting it again", flush=True)
        os.remove(db_path)
    with use_db(db_path, WorkDB.Mode.create) as db:
        cr_init([Path(module)], db, {})
        dropped = [item.job_id for item in db.work_items
                   if not operator_kept(item.mutations[0].operator_name, operators)]
        if dropped:
            db.set_multiple_results(dropped, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                                        output=f"operator not in the {operators} set"))
    common.save_json(meta_path, {"sha256": sha, "operators": operators, "seconds": {}})
    return db_path


ANNOTATION = "equivalent: inside an annotation, which `from __future__ import annotations` never evaluates"


def skip_annotation_mutants(db_path: str, tree: str, module: str) -> None:
    """Mutants inside annotations are equivalent by construction (mutation_reach.annotation_spans):
    set aside as skipped, with the reason, rather than run against the whole selection."""
    with open(os.path.join(tree, module)) as f:
        spans = mutation_reach.annotation_spans(f.read())
    if not spans:
        return
    with use_db(db_path, WorkDB.Mode.open) as db:
        results = dict(db.results)
        inside = [item.job_id for item in db.work_items
                  if mutation_reach.in_annotation(spans, item.mutations[0].start_pos)
                  and (results.get(item.job_id) is None or results[item.job_id].output != ANNOTATION)]
        if inside:
            db.set_multiple_results(inside, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=ANNOTATION))


def item_key(item) -> tuple:
    m = item.mutations[0]
    return (tuple(m.start_pos), m.operator_name, m.occurrence)


def label(item) -> str:
    m = item.mutations[0]
    return f"{m.module_path}:{m.start_pos[0]} {m.operator_name.removeprefix('core/')} #{m.occurrence}"


def classify(result: WorkResult) -> str:
    if result.worker_outcome == WorkerOutcome.SKIPPED:
        return "skipped"
    if result.worker_outcome == WorkerOutcome.NO_TEST:
        return common.NOT_VIABLE
    if result.worker_outcome != WorkerOutcome.NORMAL:
        return common.ERROR
    if result.test_outcome == TestOutcome.SURVIVED:
        return common.SURVIVED
    if result.test_outcome == TestOutcome.KILLED:
        if result.output == "timeout":
            return common.TIMEOUT
        # the runner's last line names its verdict: "error: ..." (nothing selected) is no kill
        last = (result.output or "").strip().splitlines()[-1:] or [""]
        return common.ERROR if last[0].startswith(common.ERROR + ":") else common.KILLED
    return common.ERROR


def chosen_items(db: WorkDB, module: str, sample: int, seed: int) -> list:
    """The mutants this run covers: all, or `sample` of them picked by the seed (the same ones
    on every run with the same seed, whatever was done before)."""
    items = sorted((it for it in db.work_items), key=item_key)
    skipped = {job for job, r in db.results if r.worker_outcome == WorkerOutcome.SKIPPED}
    items = [it for it in items if it.job_id not in skipped]
    if sample and sample < len(items):
        picked = random.Random(f"{seed}:{module}").sample(range(len(items)), sample)
        items = [items[i] for i in sorted(picked)]
    return items


def run_module(work: str, tree: str, module: str, opts, tree_print: str) -> None:
    db_path, meta_path = session_paths(work, module)
    with use_db(db_path, WorkDB.Mode.open) as db:
        done = {job for job, r in db.results
                if not (opts.rerun_survivors and classify(r) == common.SURVIVED)}
        todo = [it for it in chosen_items(db, module, opts.sample, opts.seed) if it.job_id not in done]
        if not todo:
            return
        secs = common.baseline(work, tree, module, tree_print)
        timeout = max(opts.min_timeout, opts.timeout_factor * secs)
        command = f"{shlex.quote(sys.executable)} {shlex.quote(os.path.join(ROOT, 'scripts', 'mutation_common.py'))}" \
                  f" --run-tests {shlex.quote(module)}"
        reach = mutation_coverage.measure(work, tree, module, tree_print) if opts.narrow else None
        with open(os.path.join(tree, module)) as f:
            source = f.read()
        only_path = os.path.join(work, "python", "only-tests.json")
        print(f"{module}: {len(todo)} mutants to run, timeout {timeout:.0f} s each", flush=True)
        for n, item in enumerate(todo, 1):
            t0 = time.monotonic()
            only = reach.selection(mutation_reach.statement_lines(source, item.mutations[0].start_pos[0])) \
                if reach is not None else None
            ran = "whole selection"
            if only is not None:
                common.save_json(only_path, only)
                result = mutate_and_test(item.mutations, f"{command} --only {shlex.quote(only_path)}", timeout)
                ran = f"{sum(len(ids or ()) for ids in only)} tests reaching it"
                if classify(result) in (common.SURVIVED, common.ERROR):  # confirmed by the whole selection
                    result = mutate_and_test(item.mutations, command, timeout)
                    ran += ", then the whole selection"
            else:
                result = mutate_and_test(item.mutations, command, timeout)
            spent = time.monotonic() - t0
            db.set_result(item.job_id, result)
            meta = common.load_json(meta_path, {})
            meta.setdefault("seconds", {})[item.job_id] = round(spent, 1)
            common.save_json(meta_path, meta)
            status = classify(result)
            print(f"  [{n}/{len(todo)}] {status:10} {spent:5.0f} s  {label(item)}  ({ran})", flush=True)
            if status == common.ERROR:
                print("    " + (result.output or "")[-600:].replace("\n", "\n    "), flush=True)


def module_score(work: str, module: str, opts) -> common.Score | None:
    db_path, meta_path = session_paths(work, module)
    if not os.path.exists(db_path):
        return None
    seconds = common.load_json(meta_path, {}).get("seconds", {})
    score = common.Score(module)
    with use_db(db_path, WorkDB.Mode.open) as db:
        results = dict(db.results)
        for item in sorted(db.work_items, key=item_key):
            result = results.get(item.job_id)
            status = common.PENDING if result is None else classify(result)
            if status != "skipped":
                score.add(status, seconds.get(item.job_id, 0.0), label(item))
    return score


def survivor_diffs(work: str, modules: list[str]) -> None:
    for module in modules:
        db_path, _ = session_paths(work, module)
        if not os.path.exists(db_path):
            continue
        with use_db(db_path, WorkDB.Mode.open) as db:
            for item, result in sorted(db.completed_work_items, key=lambda p: item_key(p[0])):
                if classify(result) == common.SURVIVED:
                    changed = [ln for ln in (result.diff or "").splitlines()
                               if ln[:1] in "+-" and not ln.startswith(("---", "+++"))]
                    print(f"{label(item)}\n    " + "\n    ".join(changed))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="modules (paths under flagos/); default: all of them")
    common.add_run_options(parser)
    parser.add_argument("--operators", choices=("reduced", "all"), default="reduced")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="run N mutants per module picked by --seed (default: every mutant)")
    parser.add_argument("--no-narrow", dest="narrow", action="store_false",
                        help="run every mutant against its module's whole selection, not first against "
                             "the tests that reach it (scripts/mutation_coverage.py)")
    parser.add_argument("--count", action="store_true",
                        help="make the sessions and print the mutants per module; run nothing")
    parser.add_argument("--survivors", action="store_true", help="print each surviving mutant's diff")
    opts = parser.parse_args()

    modules = common.mapped_files("python", opts.modules)
    if modules is None:
        return 2
    work = os.path.abspath(opts.work)
    os.makedirs(work, exist_ok=True)
    common.be_nice()
    command = "scripts/mutation_full.sh " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    if opts.survivors:
        survivor_diffs(work, modules)
        return 0
    if not opts.report:
        lock = common.hold_lock(work, "python")  # noqa: F841 (held while this process runs)
        tree = common.prepare_tree(work, "python")
        os.chdir(tree)  # cosmic-ray applies each mutant to the module path relative to here
        tree_print = common.fingerprint(tree)
        for module in modules:
            skip_annotation_mutants(open_session(work, tree, module, opts.operators), tree, module)
        if opts.count:
            total = 0
            for module in modules:
                s = module_score(work, module, opts)
                total += s.total
                print(f"{s.total:6}  {module}")
            print(f"{total:6}  mutants in all ({opts.operators} operators)")
            return 0
        try:
            for module in modules:
                run_module(work, tree, module, opts, tree_print)
        except KeyboardInterrupt:
            print("\ninterrupted: the results so far are kept; run the same command to continue")
    # every module with a session, not only this run's: the file always shows the whole picture
    scores = [s for s in (module_score(work, m, opts) for m in source_files("python")) if s is not None]
    out = os.path.join(work, "python-scores")
    note = f"{opts.operators} operators" + (f", {opts.sample} per module, seed {opts.seed}" if opts.sample else "")
    print("\n" + common.write_scores(out, scores, command, note))
    print(f"written: {out}.json, {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
