"""The command-line flags of the tiny random model every CLI and server test starts: float32 pinned, so the
figures compared against fp32 references are the same on CPUs with and without native bf16."""

TINY_CLI_ARGS = ["--load-format", "dummy", "--dummy-size", "tiny", "--dtype", "float32", "--device", "cpu"]
