"""turbomoe.inference.tiling's tune under the Triton interpreter (TRITON_INTERPRET=1, see scripts/test.sh)
or on a GPU: what a tune that fails or is interrupted leaves behind."""
import os

import pytest
import torch

from test_inference_triton import _tune_candidates, _tune_case

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 set before triton kernels are defined, or a GPU")


@pytest.mark.parametrize("exc, fails_on", [(KeyboardInterrupt, "pair"), (RuntimeError, "rule")])
def test_tune_stopped_in_the_block_timing_leaves_the_table(exc, fails_on):
    """The whole-block check puts the candidate pair in the layer's table while it times it: a tune
    stopped there (Ctrl-C, a failed launch) leaves the table as it was, not on the untried pair, nor
    without the entry it held for that token count."""
    T = 3
    moe = _tune_case(T)
    down = _tune_candidates(T, 32)[1]
    for held in ({T: (None, None)}, {5: (None, down)}):
        moe.few_rows_tiles = dict(held)
        timed = []

        def timer(op, tiles, fn):
            fn()
            if op == "layer":
                timed.append(tiles)
                if (tiles is None) == (fails_on == "rule") and len(timed) > 1:  # in the second round
                    raise exc("stopped")
            return 1.0 if (op, tiles) == ("down", down) else 9.0
        with pytest.raises(exc, match="stopped"):
            moe.tune([T], candidates=lambda T, K: [down], timer=timer, keep=1)
        assert timed[1] is not None and moe.few_rows_tiles == held
