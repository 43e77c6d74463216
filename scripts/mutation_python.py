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
it survives them, against the whole selection (with --narrowed-only not even then: the survivor
is marked as narrowed, and the next run without that option confirms it). --shard K/N splits a run's
mutants between N lanes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from attrs import evolve  # cosmic-ray's results are attrs classes
    from cosmic_ray.commands.init import init as cr_init
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult
except ImportError:
    sys.exit("cosmic-ray is not installed: run scripts/mutation_full.sh, which installs it")

import mutation_common as common
import mutation_context
import mutation_coverage
import mutation_ledger
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
# The start of a survivor's output when only the tests reaching it ran (--narrowed-only).
NARROWED = "narrowed: survived the tests that reach it; the whole selection not run\n"
# The start of a kill's output when it was carried over from an earlier source of the module
# (scripts/mutation_context.py).
CARRIED = "carried over: killed on an earlier source, in the same unchanged function\n"


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


def ledger_key(item) -> str:
    m = item.mutations[0]
    return f"{m.start_pos[0]}:{m.start_pos[1]} {m.operator_name.removeprefix('core/')} #{m.occurrence}"


def changed_lines(diff: str | None) -> list[str]:
    return [ln for ln in (diff or "").splitlines() if ln[:1] in "+-" and not ln.startswith(("---", "+++"))]


def ledger_record(result: WorkResult, seconds: float) -> dict | None:
    """What the ledger keeps of a result; None for an error (run again next time) or a skip
    (decided again from the source)."""
    status = classify(result)
    if status in (common.ERROR, "skipped"):
        return None
    record = {"status": status, "seconds": round(seconds, 1)}
    if status == common.SURVIVED:
        record["diff"] = changed_lines(result.diff)
        if (result.output or "").startswith(NARROWED):
            record["narrowed"] = True
    if status == common.KILLED and (result.output or "").startswith(CARRIED):
        record["carried"] = True
    return record


def result_from_record(record: dict) -> WorkResult:
    status, note = record["status"], "from docs/mutation/python.json"
    if status == common.NOT_VIABLE:
        return WorkResult(worker_outcome=WorkerOutcome.NO_TEST, output=f"not viable ({note})")
    if status == common.SURVIVED:
        return WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=TestOutcome.SURVIVED,
                          output=(NARROWED if record.get("narrowed") else "") + f"survived ({note})",
                          diff="\n".join(record.get("diff", [])))
    output = "timeout" if status == common.TIMEOUT else \
        (CARRIED if record.get("carried") else "") + f"killed ({note})"
    return WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=TestOutcome.KILLED, output=output)


def mutants_of(db: WorkDB) -> list[mutation_context.Mutant]:
    return [mutation_context.Mutant(ledger_key(item), m.start_pos[0], m.start_pos[1],
                                    m.operator_name.removeprefix("core/"), m.occurrence)
            for item in db.work_items for m in item.mutations[:1]]


def _git(*args: str) -> str | None:
    proc = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def earlier_entries(module: str, sha: str, operators: str, depth: int = 30) -> list[dict]:
    """The module's ledger entries for other sources with the same operator set, newest first:
    the working ledger's, then those of the ledger's last `depth` commits (current and earlier)."""
    entries = mutation_ledger.sources(mutation_ledger.load("python").get(module))
    ledger = os.path.relpath(mutation_ledger.ledger_path("python"), ROOT)
    for commit in (_git("log", f"-n{depth}", "--format=%H", "--", ledger) or "").split():
        text = _git("show", f"{commit}:{ledger}")
        entries += mutation_ledger.sources(json.loads(text).get(module) if text else None)
    seen, found = set(), []
    for entry in entries:
        if entry and entry.get("sha256") not in (sha, *seen) and entry.get("operators") == operators:
            seen.add(entry["sha256"])
            found.append(entry)
    return found


def source_in_history(module: str, sha: str, depth: int = 200) -> str | None:
    """The module's text whose sha256 is `sha`, from its last `depth` commits."""
    for commit in (_git("log", f"-n{depth}", "--format=%H", "--", module) or "").split():
        text = _git("show", f"{commit}:{module}")
        if text is not None and hashlib.sha256(text.encode()).hexdigest() == sha:
            return text
    return None


def mutants_of_source(module: str, text: str) -> list[mutation_context.Mutant]:
    """Every mutant cosmic-ray makes of `text` as `module` (an earlier source of it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, module)
        path.parent.mkdir(parents=True)
        path.write_text(text)
        with use_db(os.path.join(tmp, "session.sqlite"), WorkDB.Mode.create) as db:
            cr_init([path], db, {})
            return mutants_of(db)


def carry_over(db: WorkDB, module: str, sha: str, operators: str) -> dict[str, dict]:
    """New key -> the earlier record, for kills carried over from an earlier source."""
    with open(module) as f:  # the scratch tree's copy, the current working directory
        source = f.read()
    new_mutants = None
    carried: dict[str, dict] = {}
    for entry in earlier_entries(module, sha, operators):
        if not any(r.get("status") in mutation_context.CARRIED_STATUSES for r in entry.get("mutants", {}).values()):
            continue
        old_source = source_in_history(module, entry["sha256"])
        if old_source is None:
            continue
        new_mutants = new_mutants or mutants_of(db)
        found = mutation_context.carried_over(old_source, mutants_of_source(module, old_source),
                                              entry.get("mutants", {}), source, new_mutants)
        carried.update({k: v for k, v in found.items() if k not in carried})
    return carried


def restore_from_ledger(work: str, db_path: str, module: str, operators: str, carry: bool = True) -> None:
    """Results the ledger holds for this very source take the place of running their mutants:
    the session may be new on this machine while the work was done on another. Where it holds
    none for this source, the kills of an earlier source's mutants whose function is unchanged
    (`carry`)."""
    _, meta_path = session_paths(work, module)
    meta = common.load_json(meta_path, {})
    known = mutation_ledger.entry_for("python", module, meta.get("sha256"), operators=operators)
    with use_db(db_path, WorkDB.Mode.open) as db:
        done = {job for job, _ in db.results}
        restored, carried = 0, {}
        if carry:  # cheap where no earlier entry is left: that is known at once
            carried = {k: {**r, "carried": True} for k, r in carry_over(db, module, meta["sha256"], operators).items()}
        for item in db.work_items:
            record = known.get(ledger_key(item)) or carried.get(ledger_key(item))
            if item.job_id not in done and record is not None:
                db.set_result(item.job_id, result_from_record(record))
                meta.setdefault("seconds", {})[item.job_id] = record.get("seconds", 0.0)
                restored += 1
        total = countable(db)
    if restored:
        common.save_json(meta_path, meta)
        if carried:  # in the ledger at once, for a lane that starts on the new source later
            mutation_ledger.merge("python", module, meta["sha256"], carried, match={"operators": operators},
                                  info={"mutants_total": total})
        print(f"{module}: {restored} results taken from docs/mutation/python.json"
              + (" (kills carried over from an earlier source, scripts/mutation_context.py)" if carried else ""),
              flush=True)


def countable(db: WorkDB) -> int:
    """The module's mutants that are run and scored (all but the skipped ones)."""
    skipped = {job for job, r in db.results if r.worker_outcome == WorkerOutcome.SKIPPED}
    return sum(1 for item in db.work_items if item.job_id not in skipped)


def sync_ledger(work: str, module: str) -> None:
    """Every result of the module's session merged into the ledger (a session run by an older
    runner, or one whose per-mutant merge was interrupted)."""
    db_path, meta_path = session_paths(work, module)
    meta = common.load_json(meta_path, {})
    if not os.path.exists(db_path) or "sha256" not in meta:
        return
    seconds = meta.get("seconds", {})
    with use_db(db_path, WorkDB.Mode.open) as db:
        records = {ledger_key(item): rec for item, result in db.completed_work_items
                   if (rec := ledger_record(result, seconds.get(item.job_id, 0.0))) is not None}
        total = countable(db)
    if records:
        mutation_ledger.merge("python", module, meta["sha256"], records, match={"operators": meta["operators"]},
                              info={"mutants_total": total})


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
        # a survivor only the tests reaching it saw is run again by a run without --narrowed-only
        done = {job for job, r in db.results
                if not (classify(r) == common.SURVIVED and
                        (opts.rerun_survivors or (not opts.narrowed_only and (r.output or "").startswith(NARROWED))))}
        todo = [it for it in common.shard(chosen_items(db, module, opts.sample, opts.seed), opts.shard)
                if it.job_id not in done]
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
        sha = common.file_sha(os.path.join(tree, module))
        total = countable(db)
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
                if classify(result) == common.SURVIVED and opts.narrowed_only:
                    result = evolve(result, output=NARROWED + (result.output or ""))
                    ran += "; the whole selection not run (--narrowed-only)"
                elif classify(result) in (common.SURVIVED, common.ERROR):  # confirmed by the whole selection
                    result = mutate_and_test(item.mutations, command, timeout)
                    ran += ", then the whole selection"
            else:
                result = mutate_and_test(item.mutations, command, timeout)
            spent = time.monotonic() - t0
            db.set_result(item.job_id, result)
            meta = common.load_json(meta_path, {})
            meta.setdefault("seconds", {})[item.job_id] = round(spent, 1)
            common.save_json(meta_path, meta)
            record = ledger_record(result, spent)
            if record is not None:
                mutation_ledger.merge("python", module, sha, {ledger_key(item): record},
                                      match={"operators": opts.operators}, info={"mutants_total": total})
            status = classify(result)
            print(f"  [{n}/{len(todo)}] {status:10} {spent:5.0f} s  {label(item)}  ({ran})", flush=True)
            if status == common.ERROR:
                print("    " + (result.output or "")[-600:].replace("\n", "\n    "), flush=True)


def module_score(work: str, module: str, opts) -> common.Score | None:
    db_path, meta_path = session_paths(work, module)
    if not os.path.exists(db_path):
        return ledger_score(module, opts)
    seconds = common.load_json(meta_path, {}).get("seconds", {})
    # a mutant this session has not run may have run in another lane or on another machine
    known = mutation_ledger.entry_for("python", module, common.file_sha(os.path.join(ROOT, module)),
                                      operators=opts.operators)
    score = common.Score(module)
    with use_db(db_path, WorkDB.Mode.open) as db:
        results = dict(db.results)
        for item in sorted(db.work_items, key=item_key):
            result, record = results.get(item.job_id), known.get(ledger_key(item))
            if result is None and record is not None:
                score.add(record["status"], record.get("seconds", 0.0), label(item))
                continue
            status = common.PENDING if result is None else classify(result)
            if status != "skipped":
                score.add(status, seconds.get(item.job_id, 0.0), label(item))
    return score


def ledger_score(module: str, opts) -> common.Score | None:
    """The module's score from the ledger alone (no session on this machine), when the ledger
    holds results for the source as it is now."""
    sha = common.file_sha(os.path.join(ROOT, module))
    entry = mutation_ledger.load("python").get(module, {})
    known = mutation_ledger.entry_for("python", module, sha, operators=opts.operators)
    if not known:
        return None
    score = common.Score(module)
    for key, record in known.items():
        score.add(record["status"], record.get("seconds", 0.0), f"{module}:{key}")
    for _ in range(max(0, entry.get("mutants_total", 0) - len(known))):
        score.add(common.PENDING)
    return score


def survivor_diffs(work: str, modules: list[str]) -> None:
    for module in modules:
        db_path, _ = session_paths(work, module)
        if not os.path.exists(db_path):
            known = mutation_ledger.entry_for("python", module, common.file_sha(os.path.join(ROOT, module)))
            for key, record in sorted(known.items(), key=lambda kv: mutation_ledger.mutant_order(kv[0])):
                if record["status"] == common.SURVIVED:
                    note = "  (narrowed)" if record.get("narrowed") else ""
                    print(f"{module}:{key}{note}\n    " + "\n    ".join(record.get("diff", [])))
            continue
        with use_db(db_path, WorkDB.Mode.open) as db:
            for item, result in sorted(db.completed_work_items, key=lambda p: item_key(p[0])):
                if classify(result) == common.SURVIVED:
                    note = "  (narrowed)" if (result.output or "").startswith(NARROWED) else ""
                    print(f"{label(item)}{note}\n    " + "\n    ".join(changed_lines(result.diff)))


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
    parser.add_argument("--narrowed-only", action="store_true",
                        help="count a mutant that survives the tests reaching it as a survivor without "
                             "running the whole selection (marked 'narrowed' in the ledger; a later "
                             "run without this option runs it against both)")
    parser.add_argument("--no-carry", dest="carry", action="store_false",
                        help="run every mutant of a changed module again, not only those outside the "
                             "functions it kept unchanged (scripts/mutation_context.py)")
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
            db_path = open_session(work, tree, module, opts.operators)
            skip_annotation_mutants(db_path, tree, module)
            restore_from_ledger(work, db_path, module, opts.operators, opts.carry)
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
    for module in source_files("python"):
        sync_ledger(work, module)
    # every module with a session or ledger entry, not only this run's: the whole picture
    scores = [s for s in (module_score(work, m, opts) for m in source_files("python")) if s is not None]
    out = os.path.join(work, "python-scores")
    note = f"{opts.operators} operators" + (f", {opts.sample} per module, seed {opts.seed}" if opts.sample else "")
    print("\n" + common.write_scores(out, scores, command, note))
    print(f"written: {out}.json, {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
