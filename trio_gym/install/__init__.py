"""The installer stage: environment packages and the uv environment they need."""

from trio_gym.install.package import EnvironmentPackage, PackageError, load_package
from trio_gym.install.stage import InstallError, find_uv, install_environment

__all__ = [
    "EnvironmentPackage",
    "InstallError",
    "find_uv",
    "PackageError",
    "install_environment",
    "load_package",
]
