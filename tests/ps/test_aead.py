"""The data plane's ciphers (tfkv.ps.aead: AEGIS-128X4 from libaegis, AES-256-GCM from OpenSSL):
the standards' own test vectors, sealing and opening in place, and every way a part fails to
authenticate; and that a process without `aeg` has AES-256-GCM and never needs it."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tfkv.ps import aead

CIPHERS = [aead.Aegis128X4, aead.AesGcm256]


@pytest.fixture(params=CIPHERS, ids=lambda c: c.NAME)
def cipher(request):
    return request.param


def _sealed(cipher, aad=b"envelope", data=None):
    data = np.arange(1000, dtype=np.float32).view(np.uint8) if data is None else data
    out = np.empty(len(data) + cipher.TAG, np.uint8)
    cipher(b"k" * cipher.KEY).seal_into(b"n" * cipher.NONCE, memoryview(data), aad, out)
    return data, out


def test_a_sealed_part_opens_to_the_plaintext_into_another_buffer_or_in_place(cipher):
    data, sealed = _sealed(cipher)
    assert data.tobytes()[:64] not in sealed.tobytes()
    back = np.empty(len(data), np.uint8)
    box = cipher(b"k" * cipher.KEY)
    box.open_into(b"n" * cipher.NONCE, sealed, b"envelope", back)
    assert np.array_equal(back, data)
    box.open_into(b"n" * cipher.NONCE, sealed, b"envelope", sealed[:len(data)])  # in place
    assert np.array_equal(sealed[:len(data)], data)


@pytest.mark.parametrize("change", ["key", "nonce", "aad", "ciphertext", "tag", "truncated"])
def test_a_part_that_does_not_authenticate_is_refused_and_leaves_no_plaintext(change, cipher):
    data, sealed = _sealed(cipher)
    key, nonce, aad = b"k" * cipher.KEY, b"n" * cipher.NONCE, b"envelope"
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
    out = np.full(len(sealed) - cipher.TAG, 7, np.uint8)
    with pytest.raises(aead.InvalidTag):
        cipher(key).open_into(nonce, sealed, aad, out)
    assert not out.any()  # OpenSSL writes GCM's plaintext before it checks the tag: cleared
    with pytest.raises(aead.InvalidTag):  # shorter than a tag: refused before the cipher reads it
        cipher(key).open_into(nonce, sealed[:cipher.TAG - 1], aad, np.empty(0, np.uint8))


def test_a_key_of_another_length_is_refused(cipher):
    with pytest.raises(ValueError, match=f"{cipher.KEY} bytes"):
        cipher(b"k" * (cipher.KEY + 1))


def test_aes_256_gcm_is_the_standard_cipher():
    """The GCM specification's test case 14 (McGrew and Viega): a zero 256-bit key and IV, one zero block."""
    out = np.empty(16 + 16, np.uint8)
    aead.AesGcm256(bytes(32)).seal_into(bytes(12), bytes(16), b"", out)
    assert out.tobytes().hex() == "cea7403d4d606b6e074ec5d3baf39d18" + "d0d1c8a799996bf0265b98b5d48ab919"


def test_a_process_without_aeg_has_aes_gcm_and_imports_aeg_only_when_asked(tmp_path):
    """`aeg` hidden (as on Linux aarch64, where it has no wheel): the data plane's modules load, and
    aead.available() says AES-256-GCM only; with it, nothing loads it until a handshake asks."""
    import handshakes

    shadow = handshakes.without_aeg(tmp_path)
    code = ("import sys; from tfkv.ps import aead, channel, server, worker; from tfkv.store import dist\n"
            "assert 'aeg' not in sys.modules, 'imported at load'\n"
            "print(','.join(c.NAME for c in aead.available()))")

    def run(*first: str) -> subprocess.CompletedProcess:
        path = os.pathsep.join([*first, os.environ.get("PYTHONPATH", "")])
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": path})

    hidden = run(str(shadow))
    assert hidden.returncode == 0, hidden.stderr[-2000:]
    assert hidden.stdout.strip() == "AES-256-GCM"
    present = run()
    assert present.returncode == 0, present.stderr[-2000:]
    assert present.stdout.strip() == "AEGIS-128X4,AES-256-GCM"


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
    out = np.empty(len(msg) + aead.Aegis128X4.TAG, np.uint8)
    aead.Aegis128X4(key).seal_into(nonce, msg, ad, out)
    assert out.tobytes().hex() == ct + tag
    back = np.empty(len(msg), np.uint8)
    aead.Aegis128X4(key).open_into(nonce, out, ad, back)
    assert back.tobytes() == msg


def test_buffers_too_small_read_only_and_nonces_of_another_length_are_refused_before_the_cipher_runs(cipher):
    data, sealed = _sealed(cipher)
    box, n, tag = cipher(b"k" * cipher.KEY), b"n" * cipher.NONCE, cipher.TAG
    with pytest.raises(ValueError, match="too small|bytes, not"):
        box.seal_into(n, memoryview(data), b"", np.empty(len(data) + tag - 1, np.uint8))
    with pytest.raises(ValueError, match="too small|bytes, not"):
        box.open_into(n, sealed, b"envelope", np.empty(len(data) - 1, np.uint8))
    with pytest.raises(ValueError, match=f"{cipher.NONCE} bytes"):
        box.seal_into(b"n" * 8, memoryview(data), b"", np.empty(len(data) + tag, np.uint8))
    with pytest.raises(ValueError, match=f"{cipher.NONCE} bytes"):
        box.open_into(b"n" * 8, sealed, b"envelope", np.empty(len(data), np.uint8))
    with pytest.raises(ValueError, match="read-only"):  # a C library would get its pointer all the same
        box.open_into(n, sealed, b"envelope", bytes(len(data)))
    # A float32 array is its bytes, not its elements.
    floats = np.arange(10, dtype=np.float32)
    out = np.empty(floats.nbytes + tag, np.uint8)
    box.seal_into(n, floats, b"", out)
    back = np.empty(10, np.float32)
    box.open_into(n, out, b"", back)
    assert np.array_equal(back, floats)
