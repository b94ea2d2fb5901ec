"""Mamba-2 tensors as llama.cpp's converters wrote them, newer ([heads, 1], [groups, width / groups]) and
older (every tensor squeezed: 1-D A, D and single-group norm), back to the checkpoint's."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.gguf_mamba2 import per_layer, undo_mamba2


@pytest.mark.parametrize("squeezed", [False, True], ids=["kept_unit_dims", "squeezed"])
def test_mamba2_tensors_come_back_from_either_layout(squeezed: bool) -> None:
    rng = np.random.default_rng(0)
    a_log, d = rng.normal(size=8).astype(np.float32), rng.normal(size=8).astype(np.float32)
    norm, conv = rng.normal(size=32).astype(np.float32), rng.normal(size=(48, 1, 4)).astype(np.float32)
    a, d_file = -np.exp(a_log), d
    if not squeezed:
        a, d_file = a[:, None], d[:, None]
    name, back = undo_mamba2("ssm_a", "", a)
    assert name == "A_log"
    np.testing.assert_allclose(back, a_log, rtol=1e-6)
    assert undo_mamba2("ssm_d", "", d_file)[0] == "D"
    np.testing.assert_array_equal(undo_mamba2("ssm_d", "", d_file)[1], d)
    np.testing.assert_array_equal(undo_mamba2("ssm_norm", "weight", norm if squeezed else norm.reshape(2, 16))[1],
                                  norm)
    assert undo_mamba2("ssm_conv1d", "weight", conv[:, 0, :])[0] == "conv1d.weight"
    np.testing.assert_array_equal(undo_mamba2("ssm_conv1d", "weight", conv[:, 0, :])[1], conv)
    assert undo_mamba2("ssm_dt", "bias", d)[0] == "dt_bias"
    assert undo_mamba2("ssm_in", "weight", conv)[0] == "in_proj.weight"
    assert undo_mamba2("attn_q", "weight", conv) is None


def test_per_layer_lists_must_cover_every_layer() -> None:
    assert per_layer(4, 3, "k") == [4, 4, 4]
    assert per_layer([0, 4, 0], 3, "k") == [0, 4, 0]
    with pytest.raises(ValueError, match="k lists 2 layers, the file has 3"):
        per_layer([0, 4], 3, "k")
