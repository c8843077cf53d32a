"""The benchmark script runs end to end (interpreted, one tiny shape) so it cannot rot."""

from pallas_kernels import bench


def test_bench_tiny_interpret(tmp_path, capsys):
    out = tmp_path / "bench.md"
    rc = bench.main(["--interpret", "--tiny", "--only", "tiny decode", "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    assert "| tiny decode |" in text and "copy bandwidth" in text
    row = next(line for line in text.splitlines() if line.startswith("| tiny decode"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) > 0  # time_ms
    assert float(cells[4]) > 0  # vs_reference ran
