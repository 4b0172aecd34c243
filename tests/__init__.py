"""The test suite as a package: shared helpers in `tests.helpers` (tiny models, the doctor's tiny recipe) and
`tests.dist_scripts` (the guard tests' tiny LoRA model and faults, the subprocess harness); fixtures in conftest."""
