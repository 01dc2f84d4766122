"""GPTQ and AWQ expert formats: their layouts and bytes an expert, and their dequantisation bit for bit
against a reference written here from the formats' specifications (each int32 word's nibbles read with
Python integers, one element at a time)."""

from __future__ import annotations

import pytest
import torch

from common.experts.formats import PUBLISHED_FORMATS, get_format, quantization_error

H, INTER = 64, 96  # tiny: multiples of 32, not of 128
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble k of a word holds column 8c + this[k]
NAMES = ("gptq-g32", "gptq_v2-g32", "awq-g32", "gptq-g-1", "awq-g-1", "gptq-g16")


def _nibbles(word: int) -> list[int]:
    """The eight 4-bit fields of an int32, lowest bits first."""
    bits = word & 0xFFFFFFFF
    return [(bits >> (4 * k)) & 0xF for k in range(8)]


def gptq_reference(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, v2: bool = False
) -> torch.Tensor:
    """One GPTQ linear -> w [out, in] in fp32: qweight [in/8, out] holds input 8r+k in nibble k of row r;
    qzeros [G, out/8] output 8c+k in nibble k of column c, stored − 1 in v1; w = (q − zero) · scale of the
    input's group g_idx[i]."""
    qw, qz, sc, gi = qweight.tolist(), qzeros.tolist(), scales.float().tolist(), g_idx.tolist()
    inp, out = 8 * len(qw), len(qw[0])
    zeros = [[_nibbles(qz[g][o // 8])[o % 8] + (0 if v2 else 1) for o in range(out)] for g in range(len(qz))]
    w = [[0.0] * inp for _ in range(out)]
    for i in range(inp):
        g = gi[i]
        for o in range(out):
            w[o][i] = (_nibbles(qw[i // 8][o])[i % 8] - zeros[g][o]) * sc[g][o]
    return torch.tensor(w, dtype=torch.float32)


def awq_reference(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One AWQ GEMM linear -> w [out, in] in fp32: qweight [in, out/8] and qzeros [G, out/8] hold output
    8c + AWQ_PACK_ORDER[k] in nibble k of column c; groups of in/G consecutive inputs."""
    qw, qz, sc = qweight.tolist(), qzeros.tolist(), scales.float().tolist()
    inp, out, groups = len(qw), 8 * len(qw[0]), len(qz)

    def code(words: list[int], o: int) -> int:
        return _nibbles(words[o // 8])[AWQ_PACK_ORDER.index(o % 8)]

    w = [[0.0] * inp for _ in range(out)]
    for i in range(inp):
        g = i // (inp // groups)
        for o in range(out):
            w[o][i] = (code(qw[i], o) - code(qz[g], o)) * sc[g][o]
    return torch.tensor(w, dtype=torch.float32)


def reference(name: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's (gate_up [2I, H], down [H, I]) from its components: each linear by its reference, gate's
    and up's tensors split along the outputs."""
    out = []
    for part, pieces in (("gate_up", 2), ("down", 1)):
        linears = []
        for p in range(pieces):
            one = {}
            for n in ("qweight", "qzeros", "scales"):
                t = parts[f"{part}_{n}"]
                width = t.shape[-1] // pieces
                one[n] = t[..., p * width : (p + 1) * width]
            if name.startswith("awq"):
                linears.append(awq_reference(**one))
            else:
                g_idx = parts[f"{part}_g_idx"][p]
                linears.append(gptq_reference(**one, g_idx=g_idx, v2=name.startswith("gptq_v2")))
        out.append(torch.cat(linears))
    return out[0], out[1]


def _weights(std: float = 0.05, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * INTER, H, generator=g) * std, torch.randn(H, INTER, generator=g) * std


def test_registered_and_named() -> None:
    assert PUBLISHED_FORMATS["gptq"].name == "gptq" and PUBLISHED_FORMATS["awq"].name == "awq"
    assert get_format("gptq-g32").name == "gptq-g32" and get_format("gptq_v2").name == "gptq_v2"
    for bad in ("gptq-g0", "awq-g", "gptq_v3"):
        with pytest.raises(ValueError, match="unknown expert format"):
            get_format(bad)


def test_layouts_and_bytes() -> None:
    g = get_format("gptq-g32").components(H, INTER)
    assert g["gate_up_qweight"] == ((H // 8, 2 * INTER), torch.int32)
    assert g["gate_up_qzeros"] == ((H // 32, 2 * INTER // 8), torch.int32)
    assert g["gate_up_scales"] == ((H // 32, 2 * INTER), torch.float16)
    assert g["gate_up_g_idx"] == ((2, H), torch.int32)
    assert g["down_qweight"] == ((INTER // 8, H), torch.int32) and g["down_g_idx"] == (
        (1, INTER),
        torch.int32,
    )
    a = get_format("awq-g32").components(H, INTER)
    assert a["gate_up_qweight"] == ((H, 2 * INTER // 8), torch.int32)
    assert a["down_qzeros"] == ((INTER // 32, H // 8), torch.int32) and "down_g_idx" not in a
    n = 3 * H * INTER  # weights an expert
    groups = n // 32  # (group, output) pairs
    assert get_format("awq-g32").expert_nbytes(H, INTER) == n // 2 + groups // 2 + 2 * groups
    assert get_format("gptq-g32").expert_nbytes(H, INTER) == n // 2 + groups // 2 + 2 * groups + 4 * (
        2 * H + INTER
    )
    assert get_format("gptq-g-1").components(H, INTER)["down_scales"] == ((1, H), torch.float16)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("std", [0.02, 1.0])
def test_pack_dequantises_to_the_reference(name: str, std: float) -> None:
    fmt = get_format(name)
    gate_up, down = _weights(std)
    parts = fmt.pack(gate_up, down)
    assert {k: (tuple(v.shape), v.dtype) for k, v in parts.items()} == fmt.components(H, INTER)
    got = fmt.unpack(parts, torch.float32)
    for g, r in zip(got, reference(name, parts), strict=True):
        assert torch.equal(g, r)
    assert max(quantization_error(fmt, gate_up, down).values()) < fmt.error_bound()


@pytest.mark.parametrize("name", ["gptq-g32", "gptq_v2-g32", "awq-g32"])
def test_arbitrary_bits_dequantise_to_the_reference(name: str) -> None:
    """Every nibble value (a v1 zero of 15 reads 16), negative words, asymmetric zeros and (GPTQ) a g_idx
    that permutes the inputs among the groups, as desc_act writes it."""
    fmt = get_format(name)
    g = torch.Generator().manual_seed(3)
    parts = {}
    for key, (shape, dtype) in fmt.components(H, INTER).items():
        if key.endswith("g_idx"):
            inp = shape[1]
            parts[key] = torch.stack([torch.randperm(inp, generator=g) // 32 for _ in range(shape[0])]).int()
        elif dtype == torch.int32:
            parts[key] = torch.randint(-(2**31), 2**31, shape, generator=g, dtype=torch.int64).int()
        else:
            parts[key] = (torch.rand(shape, generator=g) * 0.01).half()
    got = fmt.unpack(parts, torch.float32)
    for a, b in zip(got, reference(name, parts), strict=True):
        assert torch.equal(a, b)
    bf16 = fmt.unpack(parts, torch.bfloat16)  # one rounding, from the exact fp32 value
    assert torch.equal(bf16[0], got[0].bfloat16())


def test_nibble_orders() -> None:
    """GPTQ packs inputs in nibble order; AWQ packs outputs 0, 2, 4, 6, 1, 3, 5, 7 (AutoAWQ's order_map)."""
    word = sum(k << (4 * k) for k in range(8))  # nibble k holds k
    signed = word - 2**32 if word >= 2**31 else word
    gptq = get_format("gptq_v2-g32")
    parts = {k: torch.zeros(s, dtype=d) for k, (s, d) in gptq.components(H, INTER).items()}
    parts["down_qweight"][0, 0] = signed
    parts["down_scales"].fill_(1)
    _, down = gptq.unpack(parts, torch.float32)
    assert down[0, :8].tolist() == list(range(8))
    awq = get_format("awq-g32")
    parts = {k: torch.zeros(s, dtype=d) for k, (s, d) in awq.components(H, INTER).items()}
    parts["down_qweight"][0, 0] = signed
    parts["down_scales"].fill_(1)
    _, down = awq.unpack(parts, torch.float32)
    assert down[:8, 0].tolist() == [
        0,
        4,
        1,
        5,
        2,
        6,
        3,
        7,
    ]  # output j holds the nibble that order_map puts it in


def test_v1_zero_is_stored_minus_one() -> None:
    sym = 0x77777777  # AutoGPTQ's symmetric zero 8, stored as 7
    for name, zero in (("gptq-g32", 8), ("gptq_v2-g32", 7)):
        fmt = get_format(name)
        parts = {k: torch.zeros(s, dtype=d) for k, (s, d) in fmt.components(H, INTER).items()}
        parts["down_qzeros"].fill_(sym)
        parts["down_scales"].fill_(1)
        _, down = fmt.unpack(parts, torch.float32)
        assert torch.equal(down, torch.full((H, INTER), -float(zero)))


@pytest.mark.parametrize("name", ["gptq-g32", "awq-g32"])
def test_unpack_many_and_mlp_agree_with_unpack(name: str) -> None:
    fmt = get_format(name)
    packed = [fmt.pack(*_weights(seed=s)) for s in range(3)]
    many = fmt.unpack_many({k: torch.stack([p[k] for p in packed]) for k in packed[0]}, torch.float32)
    for e, parts in enumerate(packed):
        one = fmt.unpack(parts, torch.float32)
        assert torch.equal(many[0][e], one[0]) and torch.equal(many[1][e], one[1])
    x = torch.randn(5, H)
    gate, up = (x @ many[0][0].T).chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate) * up) @ many[1][0].T
    torch.testing.assert_close(fmt.mlp(x, packed[0], torch.nn.functional.silu), ref)


@pytest.mark.parametrize("name", ["gptq", "awq", "gptq-g64"])
def test_dims_must_fill_groups(name: str) -> None:
    with pytest.raises(ValueError, match="group size"):
        get_format(name).components(H, INTER)  # 96 is no multiple of 64 or 128
    with pytest.raises(ValueError, match="multiples of 8"):
        get_format("awq-g-1").components(H, 36)
