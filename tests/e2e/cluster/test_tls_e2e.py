"""TLS with provided certificates: workers serve TLS and accept only coordinators whose
client certificate the cluster CA signed; the coordinator serves its clients over TLS."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.generation_params import GenerationParams
from common.tls import load_tls
from tests.support.cluster_harness import (
    cluster_name,
    start_coordinator,
    start_fetching_worker,
    start_worker,
)
from wedlm_client.client import ClusterError, WedlmClient


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def self_signed(d, stem: str, cn: str, *extra: str) -> None:
    """{stem}.key and a self-signed {stem}.pem for CN=cn."""
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={cn}",
        "-keyout", str(d / f"{stem}.key"), "-out", str(d / f"{stem}.pem"), *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a certificate it signed for 127.0.0.1 (node), and a self-signed one (other)."""
    d = tmp_path_factory.mktemp("pki")
    self_signed(d, "ca", "wedlm test CA")
    self_signed(d, "other", "other", "-addext", "subjectAltName=IP:127.0.0.1")  # not our CA's
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=node",
        "-keyout", str(d / "node.key"), "-out", str(d / "node.csr"),
    )  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509", "-req", "-in", str(d / "node.csr"), "-CA", str(d / "ca.pem"),
        "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2",
        "-extfile", str(d / "san.ext"), "-out", str(d / "node.pem"),
    )  # fmt: skip
    return d


def tls_flags(pki, stem: str = "node") -> list[str]:
    """The TLS flags of a process with certificate `stem` and the cluster CA."""
    return ["--tls-cert", str(pki / f"{stem}.pem"), "--tls-key", str(pki / f"{stem}.key"),
            "--tls-ca", str(pki / "ca.pem")]  # fmt: skip


def test_tls_cluster_end_to_end(checkpoint_dir, pki):
    model = checkpoint_dir("qwen3", seed=71, num_hidden_layers=2)
    name = cluster_name()
    tls = tls_flags(pki)
    worker, waddr = start_worker(model, name, "--no-bonjour", *tls)
    coord, address = start_coordinator(model, name, "--no-bonjour", "--worker", waddr, *tls)
    procs = [worker, coord]
    try:
        coord.expect("serving")
        client_tls = load_tls(pki / "node.pem", pki / "node.key", pki / "ca.pem")
        with WedlmClient(address, timeout=60, tls=client_tls) as client:
            out = client.generate(text="secure", params=GenerationParams(mode="ar", max_tokens=6))
        assert len(out["tokens"]) >= 1
        with WedlmClient(address, timeout=10) as plain, pytest.raises(ClusterError):
            plain.model_info()  # plaintext to a TLS port fails
        # A coordinator whose client certificate the CA did not sign is refused by the worker.
        bad = tls_flags(pki, "other")
        intruder, _ = start_coordinator(
            model,
            name,
            "--no-bonjour",
            "--no-local-layers",
            "--worker",
            waddr,
            "--wait-for-workers",
            "10",
            *bad,
        )
        procs.append(intruder)
        code, output = intruder.wait_exit(90)
        assert code == 1 and "no usable worker" in output
    finally:
        for p in procs:
            p.stop()


def test_a_worker_fetches_its_layers_over_tls(checkpoint_dir, pki, tmp_path):
    """The fetch dials the coordinator with the worker's certificate (the coordinator, given
    a CA, accepts only clients that CA signed) and checks the coordinator's against it."""
    model = checkpoint_dir("qwen3", seed=71, num_hidden_layers=2)
    name = cluster_name()
    tls = tls_flags(pki)
    worker, waddr = start_fetching_worker(name, tmp_path / "cache", *tls)
    coord, address = start_coordinator(
        model, name, "--no-bonjour", "--no-local-layers", "--worker", waddr, *tls
    )
    try:
        coord.expect("serving")
        client_tls = load_tls(pki / "node.pem", pki / "node.key", pki / "ca.pem")
        with WedlmClient(address, timeout=60, tls=client_tls) as client:
            out = client.generate(text="secure", params=GenerationParams(mode="ar", max_tokens=6))
        assert len(out["tokens"]) >= 1
        assert list((tmp_path / "cache").glob("*/model-layer-*.safetensors"))
    finally:
        for p in (worker, coord):
            p.stop()


def test_bad_tls_files_are_refused(tmp_path):
    (tmp_path / "x.pem").write_text("not a certificate")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shard_worker.cli",
            "--model",
            str(tmp_path),
            "--tls-cert",
            str(tmp_path / "x.pem"),
            "--tls-key",
            str(tmp_path / "x.pem"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
