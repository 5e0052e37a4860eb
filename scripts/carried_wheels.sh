# Sourced by the GPU-machine scripts: wheels carried in .whl/ (git-ignored) stand in for PyPI on a machine
# without network. nvidia_cutlass-*.whl gives the CUTLASS headers (setup.py finds them through
# `cutlass_library`), ninja-*.whl a parallel build. They go to a private site dir, never over the system
# packages. Needs $PY; run from the repository root.
shopt -s nullglob
wheels=(.whl/nvidia_cutlass-*.whl .whl/ninja-*.whl)
if ((${#wheels[@]})); then
  $PY -m pip install -q --no-index --no-deps --target /tmp/fa4_site "${wheels[@]}"
  export PYTHONPATH=/tmp/fa4_site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/fa4_site/bin:$PATH
fi
