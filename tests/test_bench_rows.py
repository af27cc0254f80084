"""The full-size bench's rows build the layouts their names say, abstractly (no weights are
made): stacked, but for the rows named `unstacked`, each the twin of a stacked row."""

import dataclasses

import pytest

from bench import _full_size as full_size
from flowgrpo_eqx.models import SaveDots, SaveNothing


def test_every_unstacked_row_is_a_stacked_rows_twin() -> None:
    table = {row.name: row for row in full_size.rows("all")}
    unstacked = [row for row in table.values() if not row.stacked]
    assert len(unstacked) == 2
    for row in unstacked:
        assert row.name.endswith(" unstacked")
        twin = table[row.name.removesuffix(" unstacked")]
        assert twin.stacked
        assert dataclasses.replace(twin, name=row.name, stacked=False) == row


@pytest.mark.parametrize(
    ("name", "stacked"),
    [
        ("sd35m b8 splash dots12", True),
        ("sd35m b8 splash dots12 unstacked", False),
        ("wan1.3b 480x832x33 b1 dots12 unstacked", False),
    ],
)
def test_a_rows_model_holds_its_blocks_as_its_name_says(name: str, stacked: bool) -> None:
    (row,) = full_size.rows(name)
    _, (model, *_) = full_size.program(row)
    assert model.stacked is stacked
    remat = model.block_layout.remat
    assert remat == full_size.block_remat(row.remat)
    assert remat[:12] == (SaveDots(),) * 12 and set(remat[12:]) == {SaveNothing()}
