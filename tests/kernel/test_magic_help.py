"""``%mesh``'s help through a real kernel, as a user meets it: ``%mesh?`` lists every
subcommand, ``%mesh help SUB`` and ``%mesh SUB --help`` print its full help, ``%mesh`` alone
prints the list without an error, and a typo suggests the subcommand meant.  No mesh needed."""

from __future__ import annotations

import re

import pytest
from support.kernels import ANSI, run, text

from monarch_kernel.kernel.magic_args import COMMANDS, USAGE, full_help, summary

pytestmark = pytest.mark.timeout(120)


def test_pinfo_lists_every_subcommand_with_a_line_each(module_kc):
    out, reply = run(module_kc, "%mesh?")
    assert reply["status"] == "ok", text(out)
    page = ANSI.sub("", reply["payload"][0]["data"]["text/plain"])
    assert "<no docstring>" not in page
    assert USAGE in page
    for name, fn in COMMANDS.items():
        assert re.search(rf"\n  {name} +{re.escape(summary(fn))}\n", page), f"%mesh? has no line for {name}:\n{page}"


@pytest.mark.parametrize("line", ["%mesh help spawn", "%mesh spawn --help", "%mesh spawn -n 2 -h"])
def test_help_of_a_subcommand_prints_its_full_text(module_kc, line):
    out, reply = run(module_kc, line)
    assert reply["status"] == "ok", text(out)
    assert text(out) == full_help("spawn") + "\n"
    assert "--detach M            keep the ranks running after the kernel ends" in text(out)


@pytest.mark.parametrize("line", ["%mesh", "%mesh help", "%mesh --help"])
def test_the_list_alone_is_not_an_error(module_kc, line):
    out, reply = run(module_kc, line)
    assert reply["status"] == "ok", text(out)
    assert [o.kind for o in out] == ["stream"] and out[0].name == "stdout"
    assert text(out) == USAGE + "\n"


def test_a_typo_suggests_the_nearest_subcommand(module_kc):
    out, reply = run(module_kc, "%mesh spwan -n 2")
    assert reply["status"] == "error" and reply["ename"] == "UsageError"
    assert reply["evalue"] == "%mesh spwan: unknown command; did you mean  %mesh spawn -n 2  " \
                              "(%mesh help lists every command)"
