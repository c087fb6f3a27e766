"""``--cpus``: core lists read and written, the pipelined split, and pinning a whole process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spin.cpus import available_cpus, format_cpus, parse_cpus, split


def test_core_lists_read_and_write_back() -> None:
    first = available_cpus()[0]
    assert parse_cpus(str(first)) == [first]
    cpus = available_cpus()
    assert parse_cpus(format_cpus(cpus)) == cpus
    assert format_cpus([0, 2, 3, 4, 7]) == "0,2-4,7"
    assert format_cpus([5, 1, 2]) == "1-2,5"


@pytest.mark.parametrize("spec, message", [
    ("a", "'a' is not a core number"), ("1-", "'1-' is not a core number"),
    ("3-1", "'3-1' is not a range"), ("-1", "is not a core number"),
    ("100000", "cores [100000] are not available"),
])
def test_bad_core_lists_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_cpus(spec)


def test_split_gives_the_verifier_the_most_cores() -> None:
    assert split([0, 1]) == ([0], [1])
    assert split(list(range(8))) == ([0, 1], [2, 3, 4, 5, 6, 7])
    with pytest.raises(ValueError, match="at least 2"):
        split([0])


def test_pin_moves_threads_started_before_and_after() -> None:
    """In a child process: a thread started before ``pin`` and one started after both end up on
    the pinned core only."""
    core = available_cpus()[-1]
    code = f"""
import os, threading
from spin.cpus import pin
seen = {{}}
go = threading.Event()
def early():
    go.wait(); seen["early"] = os.sched_getaffinity(0)
t = threading.Thread(target=early); t.start()
pin([{core}])
go.set(); t.join()
late = threading.Thread(target=lambda: seen.__setitem__("late", os.sched_getaffinity(0)))
late.start(); late.join()
print(sorted(seen["early"]), sorted(seen["late"]), sorted(os.sched_getaffinity(0)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("] ") == [f"[{core}", f"[{core}", f"[{core}]\n"]


def test_services_refuse_a_bad_core_list() -> None:
    r = subprocess.run([sys.executable, "-m", "spin", "verifier", "--model", "x", "--cpus",
                        "2-1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--cpus: CPU list '2-1': '2-1' is not a range" in r.stderr
