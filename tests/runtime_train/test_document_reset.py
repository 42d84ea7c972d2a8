"""Megatron's reset_position_ids + reset_attention_mask in pretraining (model.data.*): in a row packed with several
documents, every token's loss equals that of its document run alone, positions from 0, for GPT (learned positions)
and Llama (RoPE); and the loader gives every pretraining row those positions."""
import numpy as np
import pytest
import torch

from runtime.data.loader import DataParallelBatches, document_positions
from runtime.micro_batch import MicroBatch
from runtime.models import build_model
from tests.runtime_parallel import harness as H

EOD = 1


def test_positions_restart_after_each_end_of_document_token():
    rows = torch.tensor([[5, EOD, 9, 9, EOD, EOD, 7], [EOD, 2, 3, 4, 5, 6, 7]])
    assert document_positions(rows, EOD).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    samples = np.array([[5, EOD, 9, 9, EOD, EOD, 7, 3]] * 2, dtype=np.int64)
    [batch] = DataParallelBatches(samples, global_batch_size=2, micro_batch_size=2,
                                  end_of_document=EOD).batch_at(0)
    assert batch.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 0]] * 2 and batch.loss_mask is None


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_each_document_of_a_packed_row_trains_as_if_alone(arch):
    torch.manual_seed(0)
    cfg = H.tiny_config(arch, num_layers=2)
    model = build_model(cfg).eval()
    documents = [[7, 8, 9, EOD], [20, EOD], [30, 31, 32, 33, EOD], [40, 41, 42, 43]]  # max_position_embeddings 16
    row = torch.tensor([token for document in documents for token in document])
    inputs, labels = row[:-1][None], row[1:][None]
    packed = MicroBatch(inputs, labels, position_ids=document_positions(inputs, EOD)).prepare()
    with torch.no_grad():
        per_token = model(packed.input_ids, packed.labels, packed.layout)[0]
        start = 0
        for document in documents:
            end = min(start + len(document), inputs.shape[1])
            alone = model(inputs[:, start:end], labels[:, start:end])[0]
            torch.testing.assert_close(per_token[start:end], alone, rtol=1e-5, atol=1e-6)
            start = end
        # Without the reset the later documents see the earlier ones: the losses differ (the test can fail).
        assert not torch.allclose(model(inputs, labels)[0][4:], per_token[4:], rtol=1e-5, atol=1e-6)


def test_the_two_keys_go_together_with_an_end_of_document_token(recipe_data_dir, tmp_path):
    from launcher import launch
    from launcher.errors import UserError

    common = ["stages=[training]", "cluster_type=local", f"data_dir={recipe_data_dir}", f"base_results_dir={tmp_path}"]
    on = ["+training.model.data.reset_position_ids=true", "+training.model.data.reset_attention_mask=true"]
    for overrides, line in [
        # The test data's word-level tokenizer has no eos to end documents at.
        (on, "training.model.data.reset_attention_mask: true, but the tokenizer "),
        (on[:1], "training.model.data.reset_position_ids: True with reset_attention_mask: False: documents are "
                 "separated in positions and attention together here; set both to True (or both to false)"),
    ]:
        with pytest.raises(UserError) as refused:
            launch.make_plan([*common, *overrides], dry_run=False, produced_by="test")
        assert any(p.startswith(line) for p in refused.value.problems), refused.value.problems


def test_under_a_context_group_a_rank_keeps_its_tokens_and_the_whole_rows_positions():
    """The documents are found in the whole row (a boundary may sit in another rank's chunk): the rank's tokens
    are its columns, its position_ids the whole row's, and prepare() makes the context layout of them."""
    from runtime.parallel.context import sequence_index

    row = np.array([5, EOD, 9, 9, EOD, 7, 7, 7, 3], dtype=np.int64)
    columns = sequence_index(8, 1, 2, "ring")  # rank 1 of 2: chunks 1 and 2 of 4, positions 2..5
    [batch] = DataParallelBatches(np.stack([row] * 2), global_batch_size=2, micro_batch_size=2, columns=columns,
                                  end_of_document=EOD).batch_at(0)
    assert batch.input_ids.tolist() == [[9, 9, EOD, 7]] * 2
    assert batch.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]] * 2
    layout = batch.prepare().layout
    assert layout.mask is None and layout.documents.tolist() == [[1, 1, 2, 2, 2, 3, 3, 3]] * 2
