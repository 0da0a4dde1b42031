"""The data plane's cipher (tfkv.ps.aead, AEGIS-128L from libsodium): sealing and opening in
place, and every way a part fails to authenticate."""

import numpy as np
import pytest

from tfkv.ps import aead


def _sealed(key=b"k" * 16, nonce=b"n" * 16, aad=b"envelope", data=None):
    data = np.arange(1000, dtype=np.float32).view(np.uint8) if data is None else data
    out = np.empty(len(data) + aead.TAG, np.uint8)
    aead.Aead(key).seal_into(nonce, memoryview(data), aad, out)
    return data, out


def test_a_sealed_part_opens_to_the_plaintext_into_another_buffer_or_in_place():
    data, sealed = _sealed()
    assert data.tobytes()[:64] not in sealed.tobytes()
    back = np.empty(len(data), np.uint8)
    aead.Aead(b"k" * 16).open_into(b"n" * 16, sealed, b"envelope", back)
    assert np.array_equal(back, data)
    aead.Aead(b"k" * 16).open_into(b"n" * 16, sealed, b"envelope", sealed[:len(data)])  # in place
    assert np.array_equal(sealed[:len(data)], data)


@pytest.mark.parametrize("change", ["key", "nonce", "aad", "ciphertext", "tag", "truncated"])
def test_a_part_that_does_not_authenticate_is_refused(change):
    data, sealed = _sealed()
    key, nonce, aad = b"k" * 16, b"n" * 16, b"envelope"
    if change == "key":
        key = b"K" + key[1:]
    elif change == "nonce":
        nonce = nonce[:-1] + b"N"
    elif change == "aad":
        aad = b"envelopE"
    elif change in ("ciphertext", "tag"):
        sealed[5 if change == "ciphertext" else -1] ^= 1
    else:
        sealed = sealed[:-1]
    with pytest.raises(aead.InvalidTag):
        aead.Aead(key).open_into(nonce, sealed, aad, np.empty(max(len(sealed) - aead.TAG, 0), np.uint8))
    with pytest.raises(aead.InvalidTag):  # shorter than a tag: refused before libsodium reads it
        aead.Aead(key).open_into(nonce, sealed[:aead.TAG - 1], aad, np.empty(0, np.uint8))


def test_a_key_of_another_length_is_refused():
    with pytest.raises(ValueError, match="16 bytes"):
        aead.Aead(b"k" * 32)


def test_libsodium_was_initialised_with_the_cpus_aes_instructions():
    """Without sodium_init() libsodium runs its portable AES code, ~300x slower (0.05 GB/s against
    16.8 here): importing tfkv.ps.aead must have run it. libsodium reports its AES-GCM available
    exactly when sodium_init found AES-NI and PCLMUL, which is checked against the CPU's flags."""
    from nacl._sodium import lib

    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    assert bool(lib.crypto_aead_aes256gcm_is_available()) == ("aes" in flags and "pclmulqdq" in flags)


def test_buffers_too_small_and_nonces_of_another_length_are_refused_before_libsodium_runs():
    data, sealed = _sealed()
    box = aead.Aead(b"k" * 16)
    with pytest.raises(ValueError, match="too small"):
        box.seal_into(b"n" * 16, memoryview(data), b"", np.empty(len(data) + aead.TAG - 1, np.uint8))
    with pytest.raises(ValueError, match="too small"):
        box.open_into(b"n" * 16, sealed, b"envelope", np.empty(len(data) - 1, np.uint8))
    with pytest.raises(ValueError, match="16 bytes"):
        box.seal_into(b"n" * 12, memoryview(data), b"", np.empty(len(data) + aead.TAG, np.uint8))
    # A float32 array is its bytes, not its elements.
    floats = np.arange(10, dtype=np.float32)
    out = np.empty(floats.nbytes + aead.TAG, np.uint8)
    box.seal_into(b"n" * 16, floats, b"", out)
    back = np.empty(10, np.float32)
    box.open_into(b"n" * 16, out, b"", back)
    assert np.array_equal(back, floats)
