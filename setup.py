"""Maps the repository's rooms onto one installed package.

`targets/`, `relax_passes/`, `schedules/` and `runtime/` live at the top of the repository but
install as `gimlet_tvm.targets`, ... so nothing generic lands in site-packages.
"""

from setuptools import find_packages, setup

ROOMS = {
    "gimlet_tvm": "gimlet_tvm",
    "gimlet_tvm.targets": "targets",
    "gimlet_tvm.relax_passes": "relax_passes",
    "gimlet_tvm.schedules": "schedules",
    "gimlet_tvm.runtime": "runtime",
}

packages, package_dir = [], {}
for package, folder in ROOMS.items():
    package_dir[package] = folder
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(
    packages=packages,
    package_dir=package_dir,
    # The C++ runtime extensions, compiled on the device at run time (runtime/extensions.py);
    # the kernel generator protocol's JSON Schema (selection/json_schema.py).
    package_data={"gimlet_tvm.runtime": ["ext/**/*.cc", "ext/**/*.h"], "gimlet_tvm.selection": ["*.json"]},
)
