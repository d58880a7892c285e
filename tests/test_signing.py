"""Signed bundles (real Ed25519 through cryptography): keygen, sign, trusted-key loading, tamper and wrong-key refusal,
unsigned bundles refused only when keys are required, inspect shows the signer."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import dsedge
from dsedge.cli import main
from dsedge.runtime.bundle import IOSpec, Variant, read_manifest, write_manifest
from dsedge.runtime.errors import SignatureError
from dsedge.runtime.signing import ENV, check_signature, generate_key
from dsedge.toolchain.bundle_writer import write_bundle
from tiny_models import mlp_onnx

pytest.importorskip("cryptography")


@pytest.fixture
def bundle(tmp_path):
    onnx_path = mlp_onnx(tmp_path / "m.onnx")
    return write_bundle(tmp_path / "m-cpu.dse", name="m", target={"name": "cpu", "backend": "onnxruntime"},
                        inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
                        models={"models/fp32.onnx": onnx_path}, variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
                        default_variant="fp32", shape_ranges={"batch": {"min": 1, "max": 8}})


@pytest.fixture
def keys(tmp_path):
    return generate_key(tmp_path / "keys" / "release"), generate_key(tmp_path / "keys2" / "other")


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_keygen_and_sign_then_trusted_load_and_inspect(bundle, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    code, out = cli(capsys, "keygen", "--out", str(tmp_path / "k" / "ci"))
    assert code == 0 and "ed25519:" in out
    assert oct((tmp_path / "k" / "ci.key").stat().st_mode & 0o777) == "0o600"
    code, out = cli(capsys, "keygen", "--out", str(tmp_path / "k" / "ci"))
    assert code == 2 and "refusing to overwrite" in out
    code, out = cli(capsys, "sign", str(bundle), "--key", str(tmp_path / "k" / "ci.key"), "--signer", "release CI")
    assert code == 0 and (bundle / "manifest.sig").is_file()
    s = dsedge.load(bundle, trusted_keys=[tmp_path / "k" / "ci.pub"])
    assert s.run({"x": __import__("numpy").zeros((1, 64), "float32")})["logits"].shape == (1, 4)
    monkeypatch.setenv(ENV, str(tmp_path / "k"))  # a folder of .pub files
    code, out = cli(capsys, "inspect", str(bundle), "--json")
    sig = json.loads(out)["signature"]
    assert code == 0 and sig["signer"] == "release CI" and sig["trusted"] is True and sig["key_id"].startswith("ed25519:")
    monkeypatch.delenv(ENV)
    code, out = cli(capsys, "inspect", str(bundle))
    out = " ".join(out.split())  # rich wraps at the terminal width
    assert "signed by 'release CI'" in out and "not in DSEDGE_TRUSTED_KEYS" in out


def test_tampered_manifest_is_refused(bundle, keys):
    (priv, pub), _ = keys
    dsedge.runtime.signing.sign_bundle(bundle, priv)
    m = read_manifest(bundle)
    m.latency_budget_ms = 1.0  # a one-field edit, hashes re-written: the manifest verifies, the signature does not
    write_manifest(bundle, m)
    with pytest.raises(SignatureError, match="the manifest was changed after it was signed"):
        dsedge.load(bundle, trusted_keys=[pub])


def test_wrong_key_and_swapped_signer_are_refused(bundle, keys):
    (priv, pub), (priv2, pub2) = keys
    dsedge.runtime.signing.sign_bundle(bundle, priv, signer="release")
    with pytest.raises(SignatureError, match="not a trusted key"):
        dsedge.load(bundle, trusted_keys=[pub2])
    doc = json.loads((bundle / "manifest.sig").read_text())
    doc["signer"] = "someone else"  # the signer name is signed too
    (bundle / "manifest.sig").write_text(json.dumps(doc))
    with pytest.raises(SignatureError, match="the signer name or the signature in manifest.sig was changed after it"):
        dsedge.load(bundle, trusted_keys=[pub])


def test_unsigned_is_refused_only_when_keys_are_required(bundle, keys, monkeypatch):
    (_, pub), _ = keys
    monkeypatch.delenv(ENV, raising=False)
    assert check_signature(bundle) is None
    dsedge.load(bundle)  # no keys configured: loads
    with pytest.raises(SignatureError, match="unsigned and trusted keys are configured"):
        dsedge.load(bundle, trusted_keys=[pub])
    monkeypatch.setenv(ENV, os.fspath(pub))
    with pytest.raises(SignatureError, match="unsigned"):
        dsedge.load(bundle)
    with pytest.raises(SignatureError, match="trusted_keys is empty"):  # [] never switches the requirement off
        dsedge.load(bundle, trusted_keys=[])
    monkeypatch.setenv(ENV, os.fspath(pub) + ".missing")
    with pytest.raises(SignatureError, match="not found"):  # a misconfigured key fails closed
        dsedge.load(bundle)
    monkeypatch.delenv(ENV)
    # a user's pass: '' was reported as "trusted key file '.' not found", and a folder as "not found"
    with pytest.raises(SignatureError, match="a trusted key path is empty"):
        dsedge.load(bundle, trusted_keys=[""])
    with pytest.raises(SignatureError, match="is a folder, not a .pub file") as e:
        dsedge.load(bundle, trusted_keys=[pub.parent])
    assert "release.pub" in e.value.hint


def test_a_signed_bundle_copied_whole_still_verifies_and_a_swapped_model_does_not_load(bundle, keys, tmp_path):
    (priv, pub), _ = keys
    dsedge.runtime.signing.sign_bundle(bundle, priv)
    copy = shutil.copytree(bundle, tmp_path / "copy.dse")
    assert check_signature(copy, [pub]).trusted
    shutil.copy(mlp_onnx(tmp_path / "other.onnx", seed=3), copy / "models/fp32.onnx")
    with pytest.raises(dsedge.runtime.errors.BundleIntegrityError, match="corrupt or was modified"):
        dsedge.load(copy, trusted_keys=[pub])  # the signature holds, the file hash it covers does not


def test_a_linked_signature_is_refused(bundle, keys, tmp_path):
    """A symlinked manifest.sig was followed outside the bundle (a symlinked manifest.json already was refused)."""
    (priv, pub), _ = keys
    dsedge.runtime.signing.sign_bundle(bundle, priv)
    outside = tmp_path / "elsewhere.sig"
    (bundle / "manifest.sig").rename(outside)
    (bundle / "manifest.sig").symlink_to(outside)
    try:
        with pytest.raises(SignatureError, match="manifest.sig of .* is a link"):
            dsedge.load(bundle, trusted_keys=[pub])
    finally:
        (bundle / "manifest.sig").unlink()


def test_keygen_and_sign_refuse_empty_names_and_a_resign_says_what_it_replaced(bundle, keys, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    for prefix in ("", str(tmp_path / "keys") + "/"):
        code, out = cli(capsys, "keygen", "--out", prefix)
        assert code == 2 and "has no file name" in out and "Traceback" not in out
    assert not list(tmp_path.glob(".*key")) and not list(tmp_path.glob("*.key"))
    (release_key, _), (other_key, _) = keys
    code, out = cli(capsys, "sign", str(bundle), "--key", str(release_key), "--signer", " ")
    assert code == 2 and "--signer is empty" in out and not (bundle / "manifest.sig").exists()
    code, out = cli(capsys, "sign", str(bundle), "--key", str(release_key))
    assert code == 0 and "replaced" not in out
    first = json.loads((bundle / "manifest.sig").read_text())["key_id"]
    code, out = cli(capsys, "sign", str(bundle), "--key", str(other_key))
    assert code == 0 and f"note: this replaced its signature by {first}" in " ".join(out.split()), out
    code, out = cli(capsys, "sign", str(bundle), "--key", str(other_key))
    assert code == 0 and "replaced" not in out  # the same key again: nothing to say


def test_keygen_that_cannot_write_the_pub_leaves_no_lone_key(tmp_path, capsys):
    """Found by a user: with PREFIX.pub a dangling link (its target's folder missing) keygen wrote PREFIX.key, then
    failed on the .pub, and every rerun refused because "PREFIX.key exists". Both paths are checked before either
    is written; a link (even a dangling one) or a directory there is refused with nothing written."""
    (tmp_path / "ci.pub").symlink_to(tmp_path / "gone" / "ci.pub")
    (tmp_path / "dir.pub").mkdir()
    for name, words in (("ci", "ci.pub is a link"), ("dir", "dir.pub is a directory")):
        code, out = cli(capsys, "keygen", "--out", str(tmp_path / name))
        assert code == 2 and words in out and "Traceback" not in out, out
        assert not (tmp_path / f"{name}.key").exists()
    assert not (tmp_path / "gone").exists()  # nothing was written through the link
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ci.pub", "dir.pub"]  # no key, no temp file
    (tmp_path / "ci.pub").unlink()
    code, out = cli(capsys, "keygen", "--out", str(tmp_path / "ci"))  # the rerun writes the pair
    assert code == 0 and (tmp_path / "ci.key").is_file() and (tmp_path / "ci.pub").is_file(), out


def _swap_manifest_after_first_read(monkeypatch, bundle, edited: bytes) -> list:
    """Replace manifest.json by ``edited`` (atomically, as an attacker would) right after its first open: a loader
    that reads it twice checks the signature over one manifest and parses the other."""
    import builtins
    import io

    real = io.open
    opened = []

    def hooked(file, mode="r", *a, **k):
        f = real(file, mode, *a, **k)
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == str(bundle / "manifest.json") \
                and "r" in mode:
            opened.append(mode)
            if len(opened) == 1:
                (bundle / ".edited").write_bytes(edited)
                os.replace(bundle / ".edited", bundle / "manifest.json")
        return f

    monkeypatch.setattr(io, "open", hooked)
    monkeypatch.setattr(builtins, "open", hooked)
    return opened


def test_the_signature_covers_the_very_manifest_bytes_that_load_parses(bundle, keys, monkeypatch):
    """TOCTOU: load read manifest.json once for the signature and again to parse it; a manifest swapped in between
    (signed → edited) was loaded unsigned with trusted keys configured."""
    (priv, pub), _ = keys
    monkeypatch.delenv(ENV, raising=False)
    dsedge.runtime.signing.sign_bundle(bundle, priv)
    doc = json.loads((bundle / "manifest.json").read_bytes())
    assert doc.get("latency_budget_ms") != 1.0
    doc["latency_budget_ms"] = 1.0  # hashes unchanged: only the signature can tell
    edited = json.dumps(doc, indent=1).encode()
    opened = _swap_manifest_after_first_read(monkeypatch, bundle, edited)
    s = dsedge.load(bundle, trusted_keys=[pub], instances=1)
    try:
        assert s.manifest.latency_budget_ms == doc.get("latency_budget_ms") or s.manifest.latency_budget_ms != 1.0
        assert s.manifest.latency_budget_ms != 1.0  # the signed manifest, not the swapped-in one
    finally:
        s.close()
    assert len(opened) == 1, opened  # one read of manifest.json in load
    monkeypatch.undo()
    assert (bundle / "manifest.json").read_bytes() == edited
    with pytest.raises(SignatureError, match="the manifest was changed after it was signed"):
        dsedge.load(bundle, trusted_keys=[pub])  # the edited manifest itself is refused end to end


def _sig(bundle) -> dict:
    return json.loads((bundle / "manifest.sig").read_text())


@pytest.mark.parametrize("content", ["[]", "{", '"x"', "null", "FORGE31", "FORGEsig", "\xff", "HUGE", "DEEP"])
def test_a_malformed_signature_is_one_line_and_breaks_no_plain_load(bundle, keys, monkeypatch, capsys, caplog,
                                                                     content):
    import base64

    (priv, pub), _ = keys
    monkeypatch.delenv(ENV, raising=False)
    dsedge.runtime.signing.sign_bundle(bundle, priv)
    huge = False
    if content == "FORGE31":  # a 31-byte public key
        doc = _sig(bundle)
        doc["public_key"] = base64.b64encode(b"x" * 31).decode()
        content = json.dumps(doc)
    elif content == "HUGE":  # 2 MiB: read whole before (a 2 GB one took 6.5 s and 2 GB of memory)
        content = json.dumps({**_sig(bundle), "pad": "x" * (2 << 20)})
        huge = True
    elif content == "DEEP":  # a user's pass: '[' x 100000 raised RecursionError through load, inspect, sign
        content = "[" * 100_000 + "]" * 100_000
    elif content == "FORGEsig":  # a signature that is not a string
        doc = _sig(bundle)
        doc["signature"] = 5
        content = json.dumps(doc)
    (bundle / "manifest.sig").write_bytes(content.encode("latin-1"))
    with caplog.at_level("WARNING"):
        s = dsedge.load(bundle, instances=1)  # nothing required: it loads, with a warning
    s.close()
    assert any("manifest.sig of m-cpu.dse is malformed" in r.getMessage() for r in caplog.records)
    info = check_signature(bundle)
    assert info is not None and info.valid is False and "malformed" in info.error
    assert ("over 1 MiB" in info.error) == huge, info.error
    with pytest.raises(SignatureError, match="manifest.sig of m-cpu.dse is malformed"):
        dsedge.load(bundle, trusted_keys=[pub])
    monkeypatch.setenv(ENV, os.fspath(pub))
    capsys.readouterr()
    code, out = cli(capsys, "inspect", str(bundle))
    assert code == 2 and "Traceback" not in out, out
    assert out.strip().splitlines()[0].startswith("error: manifest.sig of m-cpu.dse is malformed (")
    assert out.strip().splitlines()[1].startswith("  hint: sign the bundle again"), out


def test_wrong_trusted_keys_types_are_input_errors(bundle, keys, monkeypatch):
    (priv_path, pub), _ = keys
    monkeypatch.delenv(ENV, raising=False)
    dsedge.runtime.signing.sign_bundle(bundle, priv_path)
    private = dsedge.runtime.signing.load_private_key(priv_path)
    for bad, msg in ((False, "trusted_keys must be a list of public keys, got bool False"),
                     (123, "trusted_keys must be a list of public keys, got int 123"),
                     ({"k": pub}, "got dict"),
                     ([123], "a trusted key is a int"),
                     ([pub, None], "a trusted key is a NoneType"),
                     (private, "a trusted key is a private key object"),
                     ([private], "a trusted key is a private key object")):
        with pytest.raises(dsedge.runtime.errors.InputError, match=msg) as e:
            dsedge.load(bundle, trusted_keys=bad)
        assert "\n" not in str(e.value) and e.value.hint
    with pytest.raises(SignatureError, match="^a trusted key is not a PEM public key"):
        dsedge.load(bundle, trusted_keys=[b"not a key"])
    junk = bundle.parent / "other-keys" / "junk.pub"  # a folder of keys with one bad file: that file is named
    junk.parent.mkdir()
    junk.write_text("not a key\n")
    monkeypatch.setenv(ENV, str(junk.parent))
    with pytest.raises(SignatureError, match=f"^trusted key file '{junk}' is not a PEM public key"):
        dsedge.load(bundle)
    monkeypatch.delenv(ENV)
    s = dsedge.load(bundle, trusted_keys=[private.public_key()], instances=1)  # a public key object is fine
    s.close()


def test_a_forged_key_id_does_not_make_an_attackers_key_trusted(bundle, keys, tmp_path):
    """The trust decision compared manifest.sig's 64-bit key_id and verified with the public key manifest.sig
    carries: an attacker's key with a trusted key's id written beside it was trusted."""
    import base64

    (priv, pub), (evil_priv, _) = keys
    dsedge.runtime.signing.sign_bundle(bundle, evil_priv, signer="release")  # valid under the attacker's own key
    trusted_id = dsedge.runtime.signing.key_id(dsedge.runtime.signing.load_public_key(pub))
    doc = _sig(bundle)
    assert doc["key_id"] != trusted_id
    doc["key_id"] = trusted_id  # forged: the id is not signed
    (bundle / "manifest.sig").write_text(json.dumps(doc))
    with pytest.raises(SignatureError, match="names trusted key .* but carries another public key"):
        dsedge.load(bundle, trusted_keys=[pub])
    with pytest.raises(SignatureError):
        check_signature(bundle, [pub])
    # the trusted public key written into manifest.sig, over the attacker's signature: refused too
    trusted_raw = dsedge.runtime.signing._raw_public(dsedge.runtime.signing.load_public_key(pub))
    doc["public_key"] = base64.b64encode(trusted_raw).decode()
    (bundle / "manifest.sig").write_text(json.dumps(doc))
    with pytest.raises(SignatureError, match="signature does not match"):
        dsedge.load(bundle, trusted_keys=[pub])
    dsedge.runtime.signing.sign_bundle(bundle, priv)  # the real key: trusted
    assert check_signature(bundle, [pub]).trusted is True


def test_a_failed_sign_leaves_no_temp_file_in_the_bundle(bundle, keys, capsys):
    (priv, _), _ = keys
    (bundle / "manifest.sig").mkdir()  # os.replace(file, directory) fails
    before = sorted(p.name for p in bundle.iterdir())
    code, out = cli(capsys, "sign", str(bundle), "--key", str(priv))
    assert code != 0 and "Traceback" not in out
    assert sorted(p.name for p in bundle.iterdir()) == before  # no .manifest.sig.XXXX left
    assert (bundle / "manifest.sig").is_dir()


def test_sign_refuses_a_signer_past_200_characters(bundle, keys, capsys):
    """A user's pass: a 100,000-character --signer was recorded (inspect and verify show it)."""
    (priv, _), _ = keys
    code, out = cli(capsys, "sign", str(bundle), "--key", str(priv), "--signer", "x" * 201)
    assert code == 2 and "at most 200" in out and not (bundle / "manifest.sig").exists(), out
    code, out = cli(capsys, "sign", str(bundle), "--key", str(priv), "--signer", "x" * 200)
    assert code == 0 and (bundle / "manifest.sig").exists(), out
