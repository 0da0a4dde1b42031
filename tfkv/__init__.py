"""tfkv: declarative multi-device and distributed training on TensorFlow through an MXNet-style KVStore.

Importing tfkv does not import TensorFlow; the modules that need it import it themselves, so the
config layer, the launcher and the parameter-server roles start fast and run without it.
"""

__version__ = "0.1.0"


def conf_dir() -> str:
    """tfkv's config tree (conf/: config.yaml and its option groups): inside the installed package,
    or at the top of a source checkout. Here, at the package's root, because `tfkv-run` points
    Hydra at it before anything heavier than the standard library is imported (tfkv.config
    imports Hydra)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise RuntimeError(f"tfkv's config tree is missing (looked in {here / 'conf'}); reinstall tfkv")


def stack() -> dict[str, str | None]:
    """The versions of tfkv and what it runs on (None: not installed), read from the installed
    packages' metadata: TensorFlow is not imported, so this answers in a blink. One definition for
    `--version` (below) and the benchmarks' records of the machine they ran on."""
    from importlib import metadata

    def installed(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    try:
        import zmq

        libzmq: str | None = zmq.zmq_version()
    except ImportError:
        libzmq = None
    return {"tfkv": installed("tfkv"),
            "tensorflow": installed("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tf-nightly", "tensorflow-intel"),
            "hydra": installed("hydra-core"), "pyzmq": installed("pyzmq"), "libzmq": libzmq}


def versions() -> str:
    """tfkv's version and those of what it runs on, read from the installed packages' metadata
    (TensorFlow is not imported: this answers in a blink).

    What `--version` prints for every tfkv command; here, at the package's root, so that the
    launcher, which imports only base modules, answers it too."""
    v = {k: value or "not installed" for k, value in stack().items()}
    return f"tfkv {v['tfkv']}, TensorFlow {v['tensorflow']}, Hydra {v['hydra']}, ZeroMQ {v['libzmq']} (pyzmq {v['pyzmq']})"
