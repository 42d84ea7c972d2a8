"""Host keys are verified before anything is sent: an unknown or changed key is refused with one line naming
the fix, trust on first use happens only when asked for, and one invocation reuses one connection."""

import subprocess

import pytest

from launcher import remote
from launcher.errors import UserError
from tests.launcher.helpers import nxdt


def _fresh(settings: dict) -> remote.SSHRunner:
    return remote.SSHRunner(settings)


def test_known_host_runs_commands_and_reads_files_over_one_connection(sshd, tmp_path):
    before = sshd.connections()
    runner = _fresh(sshd.remote())
    try:
        result = runner.run(["sh", "-c", 'echo "$1 $SLURM_CONF"', "sh", "it's $(quoted)"])
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("it's $(quoted) ") and result.stdout.strip().endswith("slurm.conf")
        (tmp_path / "a.exit").write_text("0\n")
        assert runner.glob(str(tmp_path), "*.exit") == [str(tmp_path / "a.exit")]
        assert runner.read_text(str(tmp_path / "a.exit")) == "0\n"
        runner.put(tmp_path / "a.exit", str(tmp_path / "deep" / "er" / "b.exit"), 0o600)
        assert (tmp_path / "deep" / "er" / "b.exit").read_text() == "0\n"
        assert runner.run(["false"]).returncode == 1
        assert runner.run(["no-such-command-nxdt"]).returncode == 127
    finally:
        runner.close()
    assert sshd.connections() - before == 1, "every command and transfer should share one connection"


def test_unknown_host_key_is_refused(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(UserError) as error:
        _fresh(sshd.remote(known_hosts=empty)).run(["true"])
    (line,) = error.value.problems
    assert f"the host key of root@127.0.0.1:{sshd.port} is not in {empty}" in line
    assert "trust_unknown_host=true" in line
    assert empty.read_text() == "", "a refused key must not be saved"


def test_changed_host_key_is_refused_even_with_trust_on_first_use(sshd, tmp_path):
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {' '.join(other.with_suffix('.pub').read_text().split()[:2])}\n")
    with pytest.raises(UserError) as error:
        _fresh(sshd.remote(known_hosts=known, trust_unknown_host=True)).run(["true"])
    assert "host key of root@127.0.0.1" in error.value.problems[0] and "changed" in error.value.problems[0]


def test_trust_on_first_use_saves_the_key(sshd, tmp_path):
    known = tmp_path / "ssh" / "known_hosts"
    runner = _fresh(sshd.remote(known_hosts=known, trust_unknown_host=True))
    try:
        assert runner.run(["true"]).returncode == 0
    finally:
        runner.close()
    assert known.read_text().strip() == f"[127.0.0.1]:{sshd.port} {sshd.host_public_key}"
    again = _fresh(sshd.remote(known_hosts=known))  # now known: no trust needed
    try:
        assert again.run(["true"]).returncode == 0
    finally:
        again.close()


def test_cli_refuses_an_unknown_host_with_one_error_line(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    result = nxdt(*sshd.overrides(known_hosts=empty), "stages=[training]", f"base_results_dir={tmp_path}/results",
                  f"data_dir={tmp_path}/data", "python=/bin/true", cwd=tmp_path, env={"NXDT_STATE_DIR": str(tmp_path / "state")})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cluster.remote.host: the host key of"), result.stderr
    assert not (tmp_path / "results").exists(), "nothing may be copied to a host that was not verified"


def test_a_remote_dry_run_renders_here_and_connects_nowhere(sshd, tmp_path):
    before = sshd.connections()
    result = nxdt(*sshd.overrides(), "stages=[training]", f"base_results_dir={tmp_path}/results",
                  f"data_dir={tmp_path}/data", "--dry-run", cwd=tmp_path, env={"NXDT_STATE_DIR": str(tmp_path / "state")})
    assert result.returncode == 0, result.stderr
    mirror = tmp_path / "state" / "remote" / "127.0.0.1" / str(tmp_path / "results").lstrip("/") / "gpt3_tiny" / "training"
    script = (mirror / "training.sbatch").read_text()
    assert "export PYTHON=python3" in script, "the laptop's interpreter means nothing on the head node"
    assert not (tmp_path / "results").exists()
    assert sshd.connections() == before


def test_a_launch_into_a_directory_the_remote_user_cannot_write_is_one_line(sshd, tmp_path):
    blocked = tmp_path / "file_not_dir"
    blocked.write_text("")
    result = nxdt(*sshd.overrides(), "stages=[training]", f"base_results_dir={blocked}/results",
                  f"data_dir={tmp_path}/data", "python=/bin/true", cwd=tmp_path,
                  env={"NXDT_STATE_DIR": str(tmp_path / "state")})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: cluster.remote.host: cannot write ") and "may write" in line


@pytest.mark.parametrize("overrides,expected", [
    (["cluster.remote.host=head", "cluster_type=local"], "cluster_type: 'local' with cluster.remote.host set"),
    (["cluster.remote.host=head", "cluster.remote.key_file=/no/such/key"], "cluster.remote.key_file: /no/such/key does not exist"),
    (["cluster.remote.host=head", "cluster.remote.port=99999"], "cluster.remote.port: 99999 is not a TCP port"),
])
def test_remote_settings_mistakes_are_one_line(tmp_path, overrides, expected):
    result = nxdt("stages=[training]", f"base_results_dir={tmp_path}/results", "--dry-run", *overrides, cwd=tmp_path,
                  env={"NXDT_STATE_DIR": str(tmp_path / "state")})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), result.stderr
