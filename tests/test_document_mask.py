"""--document_mask: text packed from several documents per block, each token attending within its own document,
positions restarting at each one (Llama 3's and torchtitan's training).

The packing itself (positions, document starts, targets); the refusals; then every strategy against one
process within 1e-5, 4 fp32 steps of 64-token blocks packed from short documents (a Python module's
paragraphs in pieces of 3 lines: half the blocks hold several, and every block has a document across a
chunk border at cp 4): DDP, FSDP, TP, PP (the positions travel with the hidden states), the ring at cp 2
and 4 and Ulysses at cp 2, Local SGD (K 1, SGD), EP with the built-in MoE, train_hybrid.py's pp 2 x tp 2
with sequence parallel; a 🤗 Llama (transformers masks packed documents by their positions) under TP, PP
and the ring; gpt-oss, whose forward does not, refused in one line."""

import json
import sys

import pytest

from conftest import SCRIPTS, TINY, assert_same_losses, run_in_turn, run_refused, train_losses

sys.path.insert(0, str(SCRIPTS))
pytestmark = pytest.mark.xdist_group("document_mask")
STEPS = [1, 2, 3, 4]
BLOCK = 64


@pytest.fixture(scope="module")
def document_files(tmp_path_factory):
    """A Python module's paragraphs cut into pieces of at most 3 lines (858 documents, 115 bytes on average) as
    jsonl rows, the first 40 the validation file: one document per row."""
    folder = tmp_path_factory.mktemp("documents")
    documents = short_documents()
    for name, rows in (("train", documents[40:]), ("validation", documents[:40])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in rows))
    return ["--train_file", str(folder / "train.jsonl"), "--validation_file", str(folder / "validation.jsonl")]


def short_documents() -> list[str]:
    import argparse

    documents = []
    for paragraph in open(argparse.__file__, encoding="utf-8").read().split("\n\n"):
        lines = paragraph.strip("\n").split("\n")
        documents += ["\n".join(lines[i : i + 3]) for i in range(0, len(lines), 3) if "".join(lines[i : i + 3]).strip()]
    return documents


def test_blocks_carry_each_documents_positions_and_no_target_across_documents():
    from common.data import encode_and_pack

    rows = encode_and_pack({"text": ["ab", "cde", "f" * 9]}, "text", 5, documents=True)
    assert rows["input_ids"] == [[97, 98, 10, 99, 100], [101, 10, 102, 102, 102], [102, 102, 102, 102, 102]]
    assert rows["position_ids"] == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]  # again at a block's start
    assert rows["labels"] == [[-100, 98, 10, -100, 100], [-100, 10, -100, 102, 102], [-100, 102, 102, 102, 102]]
    assert "position_ids" not in encode_and_pack({"text": ["ab"]}, "text", 2)

    import torch

    from common.causal_lm import documents_of

    assert documents_of(torch.tensor(rows["position_ids"])).tolist() == [[1, 1, 1, 2, 2], [1, 1, 2, 2, 2], [1] * 5]
    # what the strategies' test trains on: half the blocks hold 2 documents or more, and in every block a
    # document crosses a border of cp 4's 8-token chunks (one rank's queries, another's keys)
    positions = torch.tensor(
        encode_and_pack({"text": short_documents()[40:]}, "text", BLOCK, documents=True)["position_ids"]
    )
    assert ((positions == 0).sum(1) >= 2).float().mean() > 0.5
    assert ((positions > 0) & (torch.arange(BLOCK) % 8 == 0)).any(1).all()


def test_what_cannot_be_masked_is_refused_in_one_line(tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("one line\nanother\n" * 100)
    results = run_refused(
        [
            ("train_ddp.py", ["--document_mask"]),  # the addition set: one problem per row, nothing packed
            ("train_ddp.py", ["--document_mask", "--train_file", lines]),
        ]
    )
    expected = [
        "--document_mask: the addition set holds one problem per row",
        "--document_mask: the rows of a .txt file",
    ]
    for result, start in zip(results, expected, strict=True):
        assert result.returncode != 0
        error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and start in error[0], result.stderr[-2000:]


def test_every_strategy_matches_one_process(tmp_path, data_cache, document_files):
    common = [*TINY, *document_files, "--document_mask", "--block_size", str(BLOCK), "--max_steps", "4"]
    common += ["--batch_size", "4", "--data_cache_dir", data_cache]
    moe = ["--n_experts", "4", "--top_k", "2", "--load_balance", "none"]
    sgd = ["--optimizer", "sgd", "--learning_rate", "0.1", "--max_grad_norm", "0"]
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "max_position_embeddings": BLOCK}))  # fmt: skip
    hf = ["--model_config", str(llama)]
    ones = {"gpt": [], "moe": moe, "sgd": sgd, "llama": hf}
    runs = {  # name: (processes, script, flags, the one-process run it must match)
        "ddp2": (2, "train_ddp.py", [], "gpt"),
        "fsdp2": (2, "train_fsdp.py", [], "gpt"),
        "tp2": (2, "train_tp.py", ["--sequence_parallel"], "gpt"),
        "pp2": (2, "train_pp.py", ["--n_microbatches", "2"], "gpt"),
        "ring2": (2, "train_cp.py", [], "gpt"),
        "ulysses2": (2, "train_cp.py", ["--cp_impl", "ulysses"], "gpt"),
        "localsgd2": (2, "train_localsgd.py", [*sgd, "--sync_every", "1"], "sgd"),
        "ep2": (2, "train_ep.py", moe, "moe"),
        "llama_tp2": (2, "train_tp.py", hf, "llama"),
        "llama_pp2": (2, "train_pp.py", [*hf, "--n_microbatches", "2"], "llama"),
        "llama_ring2": (2, "train_cp.py", hf, "llama"),
        "ring4": (4, "train_cp.py", [], "gpt"),
        "hybrid4": (4, "train_hybrid.py", ["--pp_size", "2", "--tp_size", "2", "--sequence_parallel"], "gpt"),
    }
    batch_flags = {"ddp2": ["--batch_size", "2"], "localsgd2": ["--batch_size", "2"], "ep2": ["--batch_size", "2"]}
    batch_flags |= {"fsdp2": ["--batch_size", "2"]}  # data parallel over 2: the same global batch of 4

    def case(script, name, flags):
        return [str(SCRIPTS / script), [*common, *flags, "--output_dir", str(tmp_path / name)]]

    one_cases = [case("train_ddp.py", f"one_{n}", f) for n, f in ones.items()]
    plain = [str(SCRIPTS / "train_ddp.py"), [a for a in one_cases[0][1] if a != "--document_mask"]]
    plain[1][-1] = str(tmp_path / "plain")  # the same blocks, documents not apart
    results = run_in_turn([*one_cases, plain], 1, tmp_path / "one")
    for nproc in (2, 4):
        mine = {n: r for n, r in runs.items() if r[0] == nproc}
        cases = [case(script, n, [*flags, *batch_flags.get(n, [])]) for n, (_, script, flags, _) in mine.items()]
        results += run_in_turn(cases, nproc, tmp_path / f"n{nproc}")
    for result in results:
        assert result["returncode"] == 0, result["stderr"][-3000:]
    assert "documents masked apart" in results[0]["stdout"], results[0]["stdout"][-2000:]
    for name, (_, _, _, one) in runs.items():
        ref, got = train_losses(tmp_path / f"one_{one}"), train_losses(tmp_path / name)
        assert_same_losses(ref, got, STEPS, 1e-5)
    ref, plain = train_losses(tmp_path / "one_gpt"), train_losses(tmp_path / "plain")  # the mask is real
    assert abs(ref[4] - plain[4]) > 1e-3, (ref, plain)


def test_a_family_that_attends_across_documents_is_refused(tmp_path, data_cache, document_files):
    """transformers' gpt-oss builds its masks without the position_ids: packed documents would see each other."""
    from zoo_configs import FAMILIES

    config = tmp_path / "gpt_oss.json"
    config.write_text(json.dumps({"model_type": "gpt_oss", **FAMILIES["gpt_oss"]}))
    flags = [*TINY, *document_files, "--document_mask", "--block_size", "16", "--max_steps", "1"]
    flags += ["--model_config", str(config), "--data_cache_dir", data_cache, "--output_dir", str(tmp_path / "out")]
    (result,) = run_refused([("train_ddp.py", flags)])
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(error) == 1, result.stderr[-2000:]
    assert "--document_mask: gpt_oss attends across the documents of a packed block" in error[0], error
    assert not (tmp_path / "out" / "model").exists()
