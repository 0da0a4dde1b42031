"""The data plane's cipher (tfkv.ps.aead, AEGIS-128X4 from libaegis): the draft's own test vector,
sealing and opening in place, and every way a part fails to authenticate."""

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
    with pytest.raises(aead.InvalidTag):  # shorter than a tag: refused before libaegis reads it
        aead.Aead(key).open_into(nonce, sealed[:aead.TAG - 1], aad, np.empty(0, np.uint8))


def test_a_key_of_another_length_is_refused():
    with pytest.raises(ValueError, match="16 bytes"):
        aead.Aead(b"k" * 32)


def test_the_cipher_is_aegis_128x4_as_the_cfrg_draft_specifies_it():
    """draft-irtf-cfrg-aegis-aead, AEGIS-128X4 test vector 2 (120-byte message, 8-byte AD, 256-bit
    tag): what tfkv seals is the standard cipher, whichever implementation libaegis picked for
    this CPU, so two machines with different instruction sets interoperate."""
    key, nonce = bytes(range(16)), bytes(range(16, 32))
    ad, msg = bytes.fromhex("0102030401020304"), bytes.fromhex("04050607" * 30)
    ct = ("e836118562f4479c9d35c17356a833114c21f9aa39e4dda5e5c87f4152a00fce9a7c38f832eafe8b1c12f8a7cf12a81a"
          "1ad8a9c24ba9dedfbdaa586ffea67ddc801ea97d9ab4a872f42d0e352e2713dacd609f9442c17517c5a29daf3e2a3fac"
          "4ff6b1380c4e46df7b086af6ce6bc1ed594b8dd64aed2a7e")
    tag = "69abf0f64a137dd6e122478d777e98bc422823006cf57f5ee822dd78397230b2"
    out = np.empty(len(msg) + aead.TAG, np.uint8)
    aead.Aead(key).seal_into(nonce, msg, ad, out)
    assert out.tobytes().hex() == ct + tag
    back = np.empty(len(msg), np.uint8)
    aead.Aead(key).open_into(nonce, out, ad, back)
    assert back.tobytes() == msg


def test_buffers_too_small_read_only_and_nonces_of_another_length_are_refused_before_libaegis_runs():
    data, sealed = _sealed()
    box = aead.Aead(b"k" * 16)
    with pytest.raises(ValueError, match="too small"):
        box.seal_into(b"n" * 16, memoryview(data), b"", np.empty(len(data) + aead.TAG - 1, np.uint8))
    with pytest.raises(ValueError, match="too small"):
        box.open_into(b"n" * 16, sealed, b"envelope", np.empty(len(data) - 1, np.uint8))
    with pytest.raises(ValueError, match="16 bytes"):
        box.seal_into(b"n" * 12, memoryview(data), b"", np.empty(len(data) + aead.TAG, np.uint8))
    with pytest.raises(ValueError, match="16 bytes"):
        box.open_into(b"n" * 12, sealed, b"envelope", np.empty(len(data), np.uint8))
    with pytest.raises(ValueError, match="read-only"):  # cffi would hand libaegis its pointer all the same
        box.open_into(b"n" * 16, sealed, b"envelope", bytes(len(data)))
    # A float32 array is its bytes, not its elements.
    floats = np.arange(10, dtype=np.float32)
    out = np.empty(floats.nbytes + aead.TAG, np.uint8)
    box.seal_into(b"n" * 16, floats, b"", out)
    back = np.empty(10, np.float32)
    box.open_into(b"n" * 16, out, b"", back)
    assert np.array_equal(back, floats)
