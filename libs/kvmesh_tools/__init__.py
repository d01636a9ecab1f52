"""kvmesh_tools: everything around the services that no service imports.

The ``kvmesh`` CLI, benchmarks, the virtual-time cluster simulator, trace readers
and traffic models, the replay client, the local stack launcher, plots and test
helpers. Tools may import the shared library (``kvmesh``), the stubs
(``kvmesh_api``) and, for benchmarks of one service's internals, that service's
package; ``kvmesh`` never imports ``kvmesh_tools`` (``tests/test_layout_rules.py``).
"""
