"""A byte-level BPE tokenizer with an entry for every id of a real vocabulary (Qwen3's 151,936), built offline.

A random-weights model samples every id of its vocabulary, so the tokenizer beside it must decode every one of them:
vLLM's detokenizer and verl's reward path (``tokenizer.decode(response_ids, skip_special_tokens=True)``, then the
reward function on the text) see every sampled token. The real Qwen3 tokenizer has 151,643 BPE tokens and 26 added
ones (151,643-151,668), leaving 267 ids of the embedding without a token; the GPU machines have no hub to fetch it
from either. This one has Qwen3's layout and none of its text:

- ids 0-255: the 256 bytes (byte-level, GPT-2's byte-to-character map, id = byte value);
- ids 256-151,642: BPE merges of printable ASCII: every pair of characters, then triples spread evenly over all
  95^3 (a fixed stride), so text encodes to 1-3 characters a token as a real BPE vocabulary does;
- ids 151,643-151,668: Qwen3's added tokens in Qwen3's order (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
  ..., ``<think>``, ``</think>``), special where Qwen3's are;
- ids 151,669 up to the vocabulary size: ``<|extra_N|>``, not special, so a sampled one reaches the reward as text
  and encodes back to its own id.

``write_tokenizer(path, vocab_size)`` writes ``tokenizer.json`` and ``tokenizer_config.json`` (EOS ``<|im_end|>``,
pad ``<|endoftext|>``, no BOS, as Qwen3's); make_model.py ``--vocab real`` calls it. Deterministic: the same bytes on
every machine.
"""

from __future__ import annotations

import json
from pathlib import Path

BPE_VOCAB = 151_643  # Qwen3's BPE tokens: the first added token's id
QWEN3_ADDED = [  # (content, special), Qwen3's tokenizer_config.json added_tokens_decoder, ids 151,643 on
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True), ("<|fim_pad|>", True),
    ("<|repo_name|>", True), ("<|file_sep|>", True), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]  # fmt: skip
EOS, PAD = "<|im_end|>", "<|endoftext|>"
# a stride coprime with 95^3 = 5^3 * 19^3: the triples taken are spread over every first character, not the first 16
TRIPLE_STRIDE = 7919


def byte_chars() -> list[str]:
    """GPT-2's printable stand-in character of each byte, indexed by the byte's value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The 151,643 BPE tokens (bytes, then pairs and triples of printable ASCII) and the merges that build them."""
    by_byte = byte_chars()
    vocab = {ch: i for i, ch in enumerate(by_byte)}
    printable = [by_byte[b] for b in range(0x20, 0x7F)]  # space (as GPT-2's 'Ġ') to '~': 95 characters
    n = len(printable)
    merges = []
    for a in printable:
        for b in printable:
            merges.append((a, b))
    triples = BPE_VOCAB - len(vocab) - len(merges)
    for i in range(triples):
        t = (i * TRIPLE_STRIDE) % n**3
        a, b, c = printable[t // (n * n)], printable[t // n % n], printable[t % n]
        merges.append((a + b, c))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) == BPE_VOCAB, len(vocab)
    return vocab, merges


def build(vocab_size: int):
    """The ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids (>= Qwen3's 151,669), every one decodable."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    floor = BPE_VOCAB + len(QWEN3_ADDED)
    if vocab_size < floor:
        raise ValueError(f"vocab_size {vocab_size} is below the {floor} ids of Qwen3's tokenizer")
    vocab, merges = bpe_vocab_and_merges()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    extra = [(f"<|extra_{i}|>", False) for i in range(floor, vocab_size)]
    for content, special in QWEN3_ADDED + extra:  # one at a time: each takes the next id, in this order
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"built {tok.get_vocab_size(with_added_tokens=True)} ids, wanted {vocab_size}")
    return tok


def write_tokenizer(path: str | Path, vocab_size: int, model_max_length: int = 40960) -> dict[str, int]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``; returns the ids of EOS and pad."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build(vocab_size)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"eos_token_id": tok.token_to_id(EOS), "pad_token_id": tok.token_to_id(PAD)}
