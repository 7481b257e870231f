"""Bit packing of small integer codes: `bits` bits per code, 8 codes in `bits` bytes."""

from __future__ import annotations

import torch


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that `count` codes of `bits` bits take: ceil(count / 8) * bits (count for 8 bits)."""
    return count if bits == 8 else -(-count // 8) * bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2**bits) into a flat uint8 tensor of `packed_nbytes` bytes.

    Rows of 8 codes become one integer word (code_i << bits*i), emitted as `bits` bytes; no
    per-element Python loop, any width 1..8.
    """
    codes = codes.reshape(-1)
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    n = codes.numel()
    pad = (-n) % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    if 8 % bits == 0:  # 1, 2, 4 bits: whole codes per byte, same layout as the general path
        per = 8 // bits
        rows = codes.to(torch.uint8).view(-1, per)
        out = rows[:, 0].clone()
        for i in range(1, per):
            out |= rows[:, i] << (bits * i)
        return out
    rows = codes.view(-1, 8).to(torch.int64)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (rows << shifts).sum(dim=1)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((words.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `count` codes as uint8."""
    if bits == 8:
        return packed[:count].to(torch.uint8)
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
        codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(-1)[:count]
    rows = packed.reshape(-1, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (rows << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:count].to(torch.uint8)


def digits_per_word(levels: int) -> tuple[int, int]:
    """(digits, bits) of the densest word holding up to 8 base-`levels` digits: 11 levels -> (2, 7),
    3.5 bits a digit where one digit alone would take 4; 13 -> (7, 26); 9 -> (5, 16)."""
    best = min(range(1, 9), key=lambda g: ((levels**g - 1).bit_length() / g, g))
    return best, (levels**best - 1).bit_length()


def _word_chunks(bits: int) -> list[int]:
    """A word of `bits` bits is written as chunks of 8 bits and a last one of the rest."""
    return [8] * (bits // 8) + ([bits % 8] if bits % 8 else [])


def packed_digits_nbytes(count: int, levels: int) -> int:
    """Bytes that `count` base-`levels` digits take when packed by `pack_digits`."""
    digits, bits = digits_per_word(levels)
    return sum(packed_nbytes(-(-count // digits), chunk) for chunk in _word_chunks(bits))


def pack_digits(codes: torch.Tensor, levels: int) -> torch.Tensor:
    """Pack codes < `levels` jointly: `digits_per_word` of them form one base-`levels` word of
    `bits` bits (11 levels: 2 codes in 7 bits, 3.5 bits a code where `pack_bits` takes 4). Words
    of up to 8 bits are packed by `pack_bits`; a longer word's bytes go first, each as a byte
    stream, then its remaining bits packed."""
    digits, bits = digits_per_word(levels)
    codes = codes.reshape(-1)
    pad = (-codes.numel()) % digits
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    if digits == 1:
        words = codes
    else:
        place = levels ** torch.arange(digits, device=codes.device, dtype=torch.int64)
        words = (codes.view(-1, digits).to(torch.int64) * place).sum(dim=1)
    parts, shift = [], 0
    for chunk in _word_chunks(bits):
        parts.append(pack_bits((words >> shift) & ((1 << chunk) - 1) if shift or chunk < bits else words, chunk))
        shift += chunk
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def unpack_digits(packed: torch.Tensor, levels: int, count: int) -> torch.Tensor:
    """Inverse of `pack_digits`: the first `count` codes as uint8."""
    digits, bits = digits_per_word(levels)
    words_count = -(-count // digits)
    words, shift, offset = None, 0, 0
    for chunk in _word_chunks(bits):
        nbytes = packed_nbytes(words_count, chunk)
        part = unpack_bits(packed[offset:offset + nbytes], chunk, words_count)
        words = part if words is None else words | (part.to(torch.int64) << shift)
        shift, offset = shift + chunk, offset + nbytes
    if digits == 1:
        return words[:count].to(torch.uint8)
    place = levels ** torch.arange(digits, device=packed.device, dtype=torch.int64)
    return ((words.to(torch.int64).unsqueeze(1) // place) % levels).reshape(-1)[:count].to(torch.uint8)
