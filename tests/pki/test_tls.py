"""pki/tls.py beyond the handshake (which tests/pki/test_certs.py runs for real): the job's
admission name that its relays send as their ClientHello's server name."""

from __future__ import annotations

import datetime as dt
import re
import shutil
from pathlib import Path

from nebula_cli.pki import admission_name, extend_job_pki, issue_job_pki, renew_job_pki

DAY = dt.timedelta(days=1)


def test_the_admission_name_is_the_jobs_own_and_lasts_as_long_as_its_ca_key(
        tmp_path: Path) -> None:
    job = issue_job_pki("job-a", {"east": ["e1"], "west": ["w1"]}, tmp_path / "a",
                        valid_for=DAY)
    other = issue_job_pki("job-a", {"east": ["e1"], "west": ["w1"]}, tmp_path / "b",
                          valid_for=DAY)
    name = admission_name(job.ca_cert)
    assert re.fullmatch(r"[0-9a-f]{32}\.nebula", name)
    copy = tmp_path / "ca-copy.pem"  # what every relay of the job reads: the same name
    shutil.copy(job.ca_cert, copy)
    assert admission_name(copy) == name
    assert admission_name(other.ca_cert) != name  # another CA (same job id): another name
    extended = extend_job_pki(job.root, valid_for=2 * DAY)  # live renewal: same CA key
    assert extended.ca_cert.read_bytes() != copy.read_bytes()
    assert admission_name(extended.ca_cert) == name
    resumed = renew_job_pki(job.root, valid_for=DAY)  # a resume draws a new CA
    assert admission_name(resumed.ca_cert) != name
