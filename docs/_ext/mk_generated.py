"""Pages generated from the code at each build, so the reference cannot drift from it: the
``%mesh`` magics from the same docstrings ``%mesh help`` prints (``kernel/magic_args.py``), and
the settings from the settings registry (``runtime/settings.py`` through ``runtime/config.py``).
Also the API reference's page of public names (``reference/api.md``), one autosummary entry per
name of ``monarch_kernel.__all__`` and of the public subpackages' ``__all__``, and the resolution
of a type hint that names a class where it is defined (``monarch_kernel.actor.proc_mesh.ProcMesh``)
to the page of its public name (``monarch_kernel.ProcMesh``).  Written under
``reference/_generated/`` and ``reference/api.md`` (neither tracked) when the builder starts."""

from __future__ import annotations

from pathlib import Path

GENERATED = Path(__file__).resolve().parents[1] / "reference" / "_generated"


def magics_markdown() -> str:
    """Every ``%mesh`` subcommand, and the ``%%mesh`` cell magic, with its whole ``%mesh help``."""
    from monarch_kernel.kernel import magic_args

    parts = ["The list that `%mesh` and `%mesh help` print:", "", "```text", magic_args.USAGE, "```", ""]
    for name in [*magic_args.COMMANDS, magic_args.CELL]:
        title = name if name == magic_args.CELL else f"%mesh {name}"
        fn = magic_args.cell_args if name == magic_args.CELL else magic_args.COMMANDS[name]
        parts += [f"# `{title}`", "", f"{magic_args.summary(fn).rstrip('.')}.", "",
                  "```text", magic_args.full_help(name), "```", ""]
    return "\n".join(parts)


def settings_markdown() -> str:
    """The two tables of ``python -m monarch_kernel settings --markdown``."""
    from monarch_kernel.runtime import config

    return config.markdown()


# (title, module, names, what the section is): the public surface, as ``__all__`` declares it.
def sections() -> list[tuple[str, str, list[str], str]]:
    import monarch_kernel
    from monarch_kernel import job, rdma, spmd

    tensors = set(monarch_kernel._TENSOR_NAMES)
    top = [n for n in monarch_kernel.__all__ if n not in tensors]
    return [
        ("Actors and meshes", "monarch_kernel", top,
         "Monarch's `monarch.actor` names: `from monarch_kernel import Actor, endpoint, this_host`."),
        ("Distributed tensors", "monarch_kernel", [n for n in monarch_kernel.__all__ if n in tensors],
         "Monarch's top-level `monarch` names: `import monarch_kernel as monarch`; they load torch on first use."),
        ("Jobs: hosts beyond this one", "monarch_kernel.job", list(job.__all__),
         "Monarch's `monarch.job`: where a mesh's hosts come from."),
        ("SPMD: torch.distributed on a mesh", "monarch_kernel.spmd", list(spmd.__all__),
         "Setting up `torch.distributed`, running scripts, profiles and collectives on a mesh's ranks."),
        ("RDMA: moving bytes between ranks", "monarch_kernel.rdma", list(rdma.__all__),
         "Monarch's `monarch.rdma`: one-sided reads and writes of a rank's memory."),
    ]


def api_markdown() -> str:
    import importlib

    parts = ["# API", "",
             "Every public name, generated from its docstring at each build (type hints included).", ""]
    seen: dict[int, str] = {}  # one page per object: a name exported twice links to the first
    for title, module, names, what in sections():
        mod = importlib.import_module(module)
        own = [n for n in sorted(names) if seen.setdefault(id(getattr(mod, n)), f"{module}.{n}") == f"{module}.{n}"]
        again = [f"`{n}` ({{py:obj}}`{seen[id(getattr(mod, n))]}`)" for n in sorted(names) if n not in own]
        parts += [f"## {title}", "", what, "", "```{eval-rst}", f".. currentmodule:: {module}", "",
                  ".. autosummary::", "   :toctree: _api", "", *(f"   {n}" for n in own), "```", ""]
        if again:
            parts += [f"Also exported here: {', '.join(again)}.", ""]
    parts += ["## Types the API returns", "",
              "Not imported by name in a program, but what public methods return or take.", ""]
    for module, names in sorted(RETURNED.items()):
        parts += ["```{eval-rst}", f".. currentmodule:: {module}", "", ".. autosummary::", "   :toctree: _api", "",
                  *(f"   {n}" for n in names), "```", ""]
    return "\n".join(parts)


# Classes that public methods return or take, documented where they are defined.
RETURNED = {
    "monarch_kernel.actor.actor": ["ActorInstance", "Context"],
    "monarch_kernel.actor.healing": ["Healing"],
    "monarch_kernel.actor.stream": ["Stream"],
    "monarch_kernel.actor.rank_repair": ["Restarted"],
    "monarch_kernel.actor.shape": ["Shaped"],
    "monarch_kernel.data.buffer": ["ByteSize"],
    "monarch_kernel.job.squeue": ["SqueueJob"],
    "monarch_kernel.job.tunnels": ["Tunnels"],
    "monarch_kernel.observe.stack_report": ["Frame", "RankStack", "StackReport", "ThreadStack"],
    "monarch_kernel.spmd.controller.collectives": ["GroupState"],
    "monarch_kernel.spmd.controller.profile_report": ["RankProfile"],
    "monarch_kernel.tensors.messages": ["Poisoned"],
    "monarch_kernel.runtime.failure": ["DeathInfo", "RemoteFailure"],
    "monarch_kernel.tensors.controller.fetch": ["Shown"],
    "monarch_kernel.tensors.controller.streams": ["Borrow"],
}


def public_names() -> dict[str, str]:
    """The defining module's dotted name of each public object -> its documented public name."""
    import importlib

    out = {}
    for _title, module, names, _what in sections():
        mod = importlib.import_module(module)
        for n in names:
            obj = getattr(mod, n)
            where = getattr(obj, "__module__", None)
            if where and getattr(obj, "__qualname__", None):
                out.setdefault(f"{where}.{obj.__qualname__}", f"{module}.{n}")
    for module, names in RETURNED.items():  # a bare name in a string annotation: the one documented
        for n in names:
            out.setdefault(n, f"{module}.{n}")
    return out


def resolve_public(app, env, node, contnode):
    """A cross-reference to where a public class is defined goes to its public page."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    public = app.env.mk_public.get(target) if hasattr(app.env, "mk_public") else None
    if public is None:
        return None
    domain = env.get_domain("py")
    found = domain.resolve_any_xref(env, node.get("refdoc"), app.builder, public, node, contnode)
    return found[0][1] if found else None


def write(name: str, text: str, where: Path = GENERATED) -> None:
    """Write only when changed, so Sphinx rebuilds only the pages that include a changed file."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / name
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def generate(_app) -> None:
    write("magics.md", magics_markdown())
    write("settings.md", settings_markdown())
    write("api.md", api_markdown(), GENERATED.parent)
    _app.env.mk_public = public_names()


def setup(app):
    # before autosummary's own builder-inited handler (priority 500), which reads reference/api.md
    app.connect("builder-inited", generate, priority=100)
    app.connect("missing-reference", resolve_public)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
