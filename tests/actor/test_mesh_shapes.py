"""Mesh shapes as Monarch's device meshes have them: ``rename``, ``split`` (a dim into several,
one size inferred), ``slice`` and ``flatten`` of any of them, and ``to_table()``; first on
``Shape`` alone, then on a real 2x2 mesh, whose renamed and split views call the right ranks
and name their points with the new dims.  One mesh for the module."""

from __future__ import annotations

import re

import pytest

from monarch_kernel import Actor, current_rank, endpoint, this_host
from monarch_kernel.actor.shape import Extent, Shape

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- pure


def test_rename_keeps_points_and_ranks():
    shape = Shape.full({"hosts": 2, "gpus": 3})
    r = shape.rename(gpus="tp")
    assert r.extent == Extent({"hosts": 2, "tp": 3}) and r.ranks == shape.ranks
    assert shape.rename(hosts="gpus", gpus="hosts").extent.labels == ("gpus", "hosts")  # a swap
    with pytest.raises(ValueError, match="would have dim 'hosts' twice"):
        shape.rename(gpus="hosts")
    with pytest.raises(ValueError, match=re.escape("'cpus' is not a dim of this mesh (hosts=2, gpus=3)")):
        shape.rename(cpus="x")
    with pytest.raises(TypeError, match="rename takes new names as strings"):
        shape.rename(gpus=3)


def test_split_as_monarchs():
    shape = Shape.full({"hosts": 4, "gpus": 8})
    s = shape.split(hosts=("dp", "pp"), gpus=("tp", "cp"), pp=2, cp=4)
    assert s.extent == Extent({"dp": 2, "pp": 2, "tp": 2, "cp": 4}) and s.ranks == shape.ranks
    # row-major: the point dp=1, pp=0, tp=1, cp=3 is host 2, gpu 7
    assert s.slice(dp=1, pp=0, tp=1, cp=3).ranks == (2 * 8 + 7,)
    assert shape.split(hosts=("a", "b", "c"), a=1, c=2).extent == {"a": 1, "b": 2, "c": 2, "gpus": 8}
    with pytest.raises(ValueError, match="leaves 'dp' and 'pp' unsized; give all but one a size"):
        shape.split(hosts=("dp", "pp"))
    with pytest.raises(ValueError, match=re.escape("dim 'gpus' of size 8 does not split evenly into ('tp', 'cp')")):
        shape.split(gpus=("tp", "cp"), cp=3)
    with pytest.raises(ValueError, match=re.escape("dim 'hosts' has size 4, but ('dp', 'pp') multiply to 6")):
        shape.split(hosts=("dp", "pp"), dp=2, pp=3)
    with pytest.raises(ValueError, match="split was given sizes of 'zz', which no dim splits into"):
        shape.split(hosts=("dp", "pp"), pp=2, zz=2)
    with pytest.raises(TypeError, match=re.escape("split hosts= takes the names it becomes, e.g. hosts=('dp', 'pp')")):
        shape.split(hosts="dp")


def test_views_compose_over_a_slice():
    shape = Shape.full({"hosts": 2, "gpus": 4}).slice(gpus=slice(1, 3))  # ranks 1, 2, 5, 6
    s = shape.flatten("r").split(r=("x", "y"), y=2)
    assert s.extent == {"x": 2, "y": 2} and s.ranks == (1, 2, 5, 6)
    assert s.rename(x="dp").slice(dp=1).ranks == (5, 6)


def test_to_table_text_and_html():
    from monarch_kernel.actor.mesh_table import mesh_table

    t = mesh_table(Shape.full({"hosts": 2, "gpus": 3}))
    assert str(t) == ("         gpus=0  gpus=1  gpus=2\n"
                      "hosts=0       0       1       2\n"
                      "hosts=1       3       4       5")
    assert "<th>hosts=1</th><td>3</td><td>4</td><td>5</td>" in t._repr_html_()
    three = mesh_table(Shape.full({"dp": 2, "pp": 1, "tp": 2}))
    assert str(three).split("\n\n")[1] == "dp=1:\n      tp=0  tp=1\npp=0     2     3"
    assert three._repr_html_().count("<table>") == 2 and "<caption>dp=1</caption>" in three._repr_html_()
    assert str(mesh_table(Shape.full({"gpus": 2}))) == "gpus=0  gpus=1\n     0       1"
    hosts = mesh_table(Shape.full({"hosts": 2, "gpus": 1}), ["a", "b"])  # ranks on two hosts name them
    assert str(hosts).splitlines()[1:] == ["hosts=0   0 (a)", "hosts=1   1 (b)"]


# ---------------------------------------------------------------- on a mesh


class Where(Actor):
    @endpoint
    def where(self) -> tuple:
        from monarch_kernel import context

        return current_rank().rank, dict(context().message_rank)


@pytest.fixture(scope="module")
def procs():
    with this_host().spawn_procs(per_host={"a": 2, "b": 2}) as procs:
        yield procs


def ranks_and_points(mesh) -> dict:
    return {tuple(p.items()): v for p, v in mesh.where.call().get(timeout=30).items()}


def test_a_renamed_mesh_spawns_and_calls_with_its_own_dims(procs):
    renamed = procs.rename(a="stage", b="dp")
    assert renamed.sizes == {"stage": 2, "dp": 2} and renamed.extent.labels == ("stage", "dp")
    where = renamed.spawn("where", Where)
    got = ranks_and_points(where)
    assert got == {(("stage", s), ("dp", d)): (s * 2 + d, {"stage": s, "dp": d}) for s in (0, 1) for d in (0, 1)}
    assert ranks_and_points(where.slice(stage=1)) == {(("dp", d),): (2 + d, {"dp": d}) for d in (0, 1)}
    print(renamed.to_table())
    assert str(renamed.to_table()).splitlines()[2] == "stage=1     2     3"


def test_a_split_view_of_an_actor_mesh_reaches_the_right_ranks(procs):
    where = procs.spawn("where2", Where)
    split = where.flatten("r").split(r=("x", "y"), x=2)
    assert ranks_and_points(split.slice(y=1)) == {(("x", x),): (x * 2 + 1, {"x": x}) for x in (0, 1)}
    sub = procs.slice(b=1).rename(a="pp")  # a slice, renamed, spawns on its two ranks
    assert ranks_and_points(sub.spawn("where3", Where)) == {(("pp", p),): (p * 2 + 1, {"pp": p}) for p in (0, 1)}
