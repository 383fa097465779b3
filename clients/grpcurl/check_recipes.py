"""Run the recipes of clients/grpcurl/README.md against a live stack and check their output.

    python clients/grpcurl/check_recipes.py --run-dir .gymrpc [--only NAME ...] [--tool grpcurl|gymrpc] [--fresh-stack]

The README is the single source: each fenced block whose info string reads
`sh recipe=NAME tool=TOOL` runs in bash (`set -eo pipefail`) after the `sh setup` block,
and CHECKS below says what its output must show, whichever tool produced it. A recipe
without a check, or a check without a recipe, fails the run, so the two cannot drift
apart. Blocks marked `fresh-stack` (restore) run only with `--fresh-stack`, and then alone:
they need processes that have served nothing yet. grpcurl blocks are skipped, and said so,
when grpcurl is not installed. The last line is `N passed, N failed, N skipped`; the exit
code is 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"
BLOCK = re.compile(r"^```sh ([^\n]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
TOOLS = ("grpcurl", "gymrpc")
TIMEOUT = 60.0


@dataclass(frozen=True)
class Recipe:
    name: str
    tool: str
    script: str
    fresh_stack: bool = False
    """Needs processes that have served nothing yet (a restore): run with --fresh-stack."""


@dataclass(frozen=True)
class Result:
    recipe: Recipe
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    def json(self) -> list[dict]:
        """Every JSON object printed (a server stream prints several, one after the other)."""
        decoder, text, objects, at = json.JSONDecoder(), self.stdout, [], 0
        while (at := _skip_space(text, at)) < len(text):
            value, at = decoder.raw_decode(text, at)
            objects.append(value)
        return objects

    def one(self) -> dict:
        objects = self.json()
        assert len(objects) == 1, f"expected one JSON reply, got {len(objects)}"
        return objects[0]

    def state(self) -> dict:
        return json.loads((self.run_dir / "stack.json").read_text())


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def parse(readme: Path = README) -> tuple[str, list[Recipe]]:
    """The setup block and the recipes, in file order."""
    setup, recipes = "", []
    for match in BLOCK.finditer(readme.read_text()):
        info, script = match.group(1).split(), match.group(2)
        if info == ["setup"]:
            setup = script
            continue
        fields = dict(part.split("=", 1) for part in info if "=" in part)
        if "recipe" in fields:
            if fields.get("tool") not in TOOLS:
                raise ValueError(f"recipe {fields['recipe']!r} needs tool=grpcurl or tool=gymrpc")
            recipes.append(Recipe(fields["recipe"], fields["tool"], script, "fresh-stack" in info))
    return setup, recipes


# -- what each recipe must show -----------------------------------------------------------------


def _ok(result: Result) -> None:
    assert result.returncode == 0, f"exit code {result.returncode}"


def check_services(r: Result) -> None:
    _ok(r)
    services = r.stdout.split()
    assert {"gymrpc.v1.AgentService", "grpc.health.v1.Health"} <= set(services), services


def check_methods(r: Result) -> None:
    _ok(r)
    assert re.search(r"\bRun ?\(", r.stdout), "Run is not listed"
    assert re.search(r"\bRunStream ?\(", r.stdout), "RunStream is not listed"


def check_endpoints(r: Result) -> None:
    _ok(r)
    names = {e["name"] for e in r.one()["endpoints"]}
    assert {"agent/counter", "resources/counter", "model/policy"} <= names, names


def check_resolve(r: Result) -> None:
    _ok(r)
    address = next(s["address"] for s in r.state()["servers"] if s["name"] == "agent/counter")
    assert r.one()["endpoints"][0]["address"] == address


def check_health(r: Result) -> None:
    _ok(r)
    assert r.one() == {"status": "SERVING"}


def check_tools(r: Result) -> None:
    _ok(r)
    reply = r.one()
    assert [t["name"] for t in reply["tools"]] == ["increment_counter", "get_counter_value"]
    assert reply["checkpoint_mode"] == "CHECKPOINT_MODE_EXPORTED"


def _check_trajectory(trajectory: dict, rollout_id: str, count: int) -> None:
    assert trajectory["episode_id"]["rollout_id"] == rollout_id
    assert trajectory["reward"] == 1.0, trajectory.get("verify_details_json")
    outputs = [call["output"] for call in trajectory["tool_calls"]]
    assert outputs[-1] == json.dumps({"count": count}), outputs


def check_run(r: Result) -> None:
    _ok(r)
    _check_trajectory(r.one()["trajectory"], "by-hand-1", 6)


def check_run_stream(r: Result) -> None:
    _ok(r)
    events = r.json()
    phases = [e["progress"]["phase"] for e in events[:-1]]
    assert phases[0] == "EPISODE_PHASE_READY_FOR_MODEL", phases
    assert phases[-1] == "EPISODE_PHASE_COMPLETED", phases
    _check_trajectory(events[-1]["trajectory"], "by-hand-2", 15)


def check_invalid(r: Result) -> None:
    assert r.returncode == 64 + 3, f"exit code {r.returncode}, expected 67 (INVALID_ARGUMENT)"
    assert re.search(r"invalid.?argument", r.stderr, re.IGNORECASE), r.stderr
    assert "task.input" in r.stderr, r.stderr


def check_unauthenticated(r: Result) -> None:
    assert r.returncode == 64 + 16, f"exit code {r.returncode}, expected 80 (UNAUTHENTICATED)"
    assert "unauthenticated" in r.stderr.lower(), r.stderr


def check_register(r: Result) -> None:
    _ok(r)
    reply = r.one()
    assert reply["endpoint"]["name"] == "agent/by-hand"
    assert reply["endpoint"]["address"] == "127.0.0.1:9"
    assert reply["ttl"] == "5s"


PARTICIPANTS = ["model/policy", "agent/blackjack", "agent/counter", "resources/blackjack", "resources/counter"]
CHECKPOINT = {"grpcurl": "by-hand-1", "gymrpc": "by-hand-2"}
"""The checkpoint id each tool's recipes use: a resumed id is spent."""


def _phases(replies: list[dict]) -> list[str]:
    return [reply.get("phase", "") for reply in replies]


def check_participant_status(r: Result) -> None:
    _ok(r)
    replies = r.json()
    assert [s["name"] for s in replies] == PARTICIPANTS
    assert [s["kind"] for s in replies] == [
        "PARTICIPANT_KIND_MODEL",
        *["PARTICIPANT_KIND_AGENT"] * 2,
        *["PARTICIPANT_KIND_RESOURCES"] * 2,
    ]
    assert set(_phases(replies)) == {"PARTICIPANT_PHASE_IDLE"}


def check_prepare(r: Result) -> None:
    _ok(r)
    assert _phases(r.json()) == ["PARTICIPANT_PHASE_PREPARED"] * len(PARTICIPANTS)


def check_renew(r: Result) -> None:
    _ok(r)
    replies = r.json()
    assert len(replies) == len(PARTICIPANTS)
    assert all(reply["lease_expire_time"] for reply in replies)


def check_commit(r: Result) -> None:
    _ok(r)
    replies = r.json()
    checkpoint = CHECKPOINT[r.recipe.tool]
    assert _phases(replies) == ["PARTICIPANT_PHASE_COMMITTED"] * len(PARTICIPANTS)
    for name, reply in zip(PARTICIPANTS, replies, strict=True):
        assert reply["manifest"]["checkpoint_id"] == checkpoint
        manifest = r.run_dir / "checkpoints" / checkpoint / name / "manifest.json"
        assert json.loads(manifest.read_text())["name"] == name


def check_resume(r: Result) -> None:
    _ok(r)
    assert _phases(r.json()) == ["PARTICIPANT_PHASE_IDLE"] * len(PARTICIPANTS)


def check_retire(r: Result) -> None:
    _ok(r)
    replies = r.json()
    assert len(replies) == len(PARTICIPANTS)
    assert all(reply["retired"] == [{"rollout_id": "by-hand-1"}] for reply in replies), replies  # attempt 0


def check_stale_attempt(r: Result) -> None:
    assert r.returncode == 64 + 9, f"exit code {r.returncode}, expected 73 (FAILED_PRECONDITION)"
    assert "STALE_ATTEMPT" in r.stderr, r.stderr


def check_forget(r: Result) -> None:
    _ok(r)
    assert [reply["forgotten"] for reply in r.json()] == [["by-hand-1"]] * len(PARTICIPANTS)


def check_restore(r: Result) -> None:
    _ok(r)
    replies = r.json()
    restores, resumes = replies[: len(PARTICIPANTS)], replies[len(PARTICIPANTS) :]
    assert _phases(restores) == ["PARTICIPANT_PHASE_RESTORED"] * len(PARTICIPANTS)
    assert {reply["source_checkpoint_id"] for reply in restores} == {CHECKPOINT[r.recipe.tool]}
    assert _phases(resumes) == ["PARTICIPANT_PHASE_IDLE"] * len(PARTICIPANTS)


CHECKS: dict[str, Callable[[Result], None]] = {
    "services": check_services,
    "methods": check_methods,
    "endpoints": check_endpoints,
    "resolve": check_resolve,
    "health": check_health,
    "tools": check_tools,
    "run": check_run,
    "run-stream": check_run_stream,
    "invalid": check_invalid,
    "unauthenticated": check_unauthenticated,
    "register": check_register,
    "participant-status": check_participant_status,
    "prepare": check_prepare,
    "renew": check_renew,
    "commit": check_commit,
    "resume": check_resume,
    "retire": check_retire,
    "stale-attempt": check_stale_attempt,
    "forget": check_forget,
    "restore": check_restore,
}


# -- running ------------------------------------------------------------------------------------


def run_recipe(recipe: Recipe, setup: str, run_dir: Path, env: dict[str, str]) -> Result:
    script = f"set -eo pipefail\n{setup}\n{recipe.script}"
    try:
        proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return Result(recipe, -1, "", f"timed out after {TIMEOUT:.0f} s", run_dir)
    return Result(recipe, proc.returncode, proc.stdout, proc.stderr, run_dir)


def selected(recipes: list[Recipe], args: argparse.Namespace) -> list[Recipe]:
    """The recipes to run, in the README's order: it must run top to bottom as written."""
    return [
        recipe
        for recipe in recipes
        if (args.tool is None or recipe.tool == args.tool)
        and recipe.fresh_stack == args.fresh_stack
        and (not args.only or recipe.name in args.only)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, default=Path(os.environ.get("GYMRPC_RUN_DIR", ".gymrpc")))
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these recipes only")
    parser.add_argument("--tool", choices=TOOLS, help="run one tool's forms only")
    parser.add_argument(
        "--fresh-stack",
        action="store_true",
        help="run the recipes that need a stack that has served nothing yet (restore), and only those",
    )
    args = parser.parse_args(argv)

    setup, recipes = parse()
    names = {r.name for r in recipes}
    if problems := [f"recipe {n!r} has no check" for n in sorted(names - CHECKS.keys())] + [
        f"check {n!r} has no recipe" for n in sorted(CHECKS.keys() - names)
    ]:
        print("\n".join(problems), file=sys.stderr)
        return 1
    if args.only and (unknown := set(args.only) - names):
        print(f"no recipes named {sorted(unknown)}", file=sys.stderr)
        return 2

    run_dir = args.run_dir.absolute()
    # `gymrpc` and grpcurl both live beside the interpreter in the project's venv.
    env = {
        **os.environ,
        "GYMRPC_RUN_DIR": str(run_dir),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    have_grpcurl = shutil.which("grpcurl", path=env["PATH"]) is not None
    passed = failed = skipped = 0
    for recipe in selected(recipes, args):
        label = f"{recipe.name} ({recipe.tool})"
        if recipe.tool == "grpcurl" and not have_grpcurl:
            print(f"skip {label}: grpcurl is not installed")
            skipped += 1
            continue
        started = time.monotonic()
        result = run_recipe(recipe, setup, run_dir, env)
        try:
            CHECKS[recipe.name](result)
        except (AssertionError, ValueError, KeyError, IndexError, StopIteration) as exc:
            failed += 1
            print(f"FAIL {label}: {type(exc).__name__}: {exc}")
            print(f"  stdout: {result.stdout[-2000:]}\n  stderr: {result.stderr[-2000:]}")
            continue
        passed += 1
        print(f"ok   {label} {time.monotonic() - started:.2f}s")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
