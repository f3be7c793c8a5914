"""Review of the pretraining data: empty documents, a jsonl record with a lone surrogate, Megatron datasets
with max_tokens or without tokens, and the samples of every step the same after a resume and over any
number of ranks (more ranks than training samples too)."""
import json

import numpy as np
import pytest

from test_data import EOS, build_megatron
from turbomoe.data import ArrayStream, Samples, load_stream


def test_empty_documents_add_no_tokens(tmp_path):
    """An empty document added a lone end-of-document (EOS EOS in the stream), where Megatron's
    preprocess_data.py, the pre-tokenized source's, writes no token; a corpus of only empty documents
    was a stream of end-of-documents."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("")
    (tmp_path / "docs" / "b.txt").write_text("hi")
    (tmp_path / "docs" / "c.txt").write_text("")
    stream = load_stream("text", [str(tmp_path / "docs")])
    assert stream.read(0, len(stream)).tolist() == [104, 105, EOS]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in ["", "ab", "", " "]) + "\n")
    stream = load_stream("jsonl", [str(jl)])
    assert stream.read(0, len(stream)).tolist() == [97, 98, EOS, 32, EOS]  # whitespace is a document
    jl.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="holds no documents"):
        load_stream("jsonl", [str(jl)])


def test_lone_surrogate_names_its_record(tmp_path):
    """JSON may escape a lone surrogate (scraped text does), a str with no UTF-8 bytes: its encoding failed
    in the tokenizer, a UnicodeEncodeError naming neither the file nor the line."""
    jl = tmp_path / "s.jsonl"
    jl.write_text('{"text": "ok"}\n{"text": "bad \\ud800 x"}\n')
    with pytest.raises(ValueError, match=r"s\.jsonl:2: not a UTF-8 JSON object .*surrogates not allowed"):
        load_stream("jsonl", [str(jl)])


def test_megatron_max_tokens_and_empty_dataset(tmp_path):
    """data.max_tokens was ignored for Megatron datasets (the whole corpus, another split and order); a
    dataset without tokens failed inside megatron-core ("cannot mmap an empty file"), path unnamed."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50_000, n).tolist() for n in (5, 0, 9, 4)]
    build_megatron(tmp_path / "a_text_document", docs)
    flat = [t for d in docs for t in d]
    prefix = str(tmp_path / "a_text_document")
    assert len(load_stream("megatron", [prefix])) == len(flat)
    stream = load_stream("megatron", [prefix], max_tokens=11)
    assert len(stream) == 11 and stream.read(0, 11).tolist() == flat[:11]
    assert len(load_stream("megatron", [prefix], max_tokens=1000)) == len(flat)
    samples = Samples(stream, seq_len=2, valid_fraction=0.2, seed=0)  # (11 - 1) // 2 samples
    assert len(samples.train_ids) + len(samples.valid_ids) == 5
    build_megatron(tmp_path / "empty_text_document", [[], []])
    with pytest.raises(ValueError, match=r"empty_text_document.*\.bin is empty"):
        load_stream("megatron", [prefix, str(tmp_path / "empty_text_document")])


@pytest.mark.parametrize("world, micro, accum", [(1, 1, 1), (3, 2, 2), (7, 1, 3), (40, 1, 1)])
def test_steps_cover_each_epoch_once_and_resume_exactly(world, micro, accum):
    """Every step reads the next world x micro x accum positions of the endless order, each epoch a
    permutation of the training samples, whatever the ranks (40 ranks over 9 samples: epochs in a step);
    a Samples made afresh at step 5 (a resume) reads what the uninterrupted one does."""
    stream = ArrayStream(np.arange(10 * 3 + 1))  # sample i starts with token 3 * i
    run = Samples(stream, seq_len=3, valid_fraction=0.1, seed=7)
    n = len(run.train_ids)
    per_step = world * micro * accum
    steps = -(-3 * n // per_step)  # three epochs at least
    order = []
    for step in range(steps):
        for m in range(accum):
            for rank in range(world):
                batch = run.train_batch(step, m, accum, rank, world, micro)
                assert batch.shape == (micro, 4)
                order += [int(row[0]) // 3 for row in batch]
    want = [run._train_sample_id(i) for i in range(steps * per_step)]
    assert order == want  # ranks and micro-steps of a step take consecutive positions, none twice or skipped
    for epoch in range(3):
        assert sorted(order[epoch * n:(epoch + 1) * n]) == sorted(run.train_ids.tolist())
    resumed = Samples(stream, seq_len=3, valid_fraction=0.1, seed=7)
    for step in range(min(5, steps - 1), steps):
        for m in range(accum):
            for rank in range(world):
                assert np.array_equal(resumed.train_batch(step, m, accum, rank, world, micro),
                                      run.train_batch(step, m, accum, rank, world, micro))
