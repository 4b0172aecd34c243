"""Scripts the tests launch as separate processes (torchrun / accelerate launch) and the helpers they share.

Tests import them as `tests.dist_scripts.<module>`. Run as a script, a file here imports its siblings by their
plain names (`from guards_common import ...`): Python puts the script's own directory first on `sys.path`, and
torchrun and accelerate launch run each worker as `python <script>`.
"""
