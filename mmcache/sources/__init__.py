"""Sources: one object per kind (folder, list file, tar, zip, WebDataset), in one table."""

from __future__ import annotations

from . import registry
from .base import ImageReader, Source
from .folder import FOLDER
from .listfile import LIST
from .listing import IMAGE_EXTENSIONS, Listing
from .member_table import carry_member_table, read_member_table, write_member_table
from .members import (
    Address,
    MemberAddress,
    MemberGone,
    Members,
    decode_member,
    is_member,
    member_file,
)
from .recorded import MemberFinder, RecordedMembers
from .registry import SOURCES, register, unregister
from .tar import TAR
from .webdataset import WEBDATASET
from .zip_archive import ZIP

__all__ = [
    "Address",
    "IMAGE_EXTENSIONS",
    "ImageReader",
    "SOURCES",
    "Listing",
    "MemberAddress",
    "MemberFinder",
    "MemberGone",
    "Members",
    "RecordedMembers",
    "Source",
    "carry_member_table",
    "decode_member",
    "is_member",
    "member_file",
    "read_member_table",
    "register",
    "registry",
    "unregister",
    "write_member_table",
]

# The built-in kinds, in the order they are asked (``registry.detect``): an archive before a
# list file before a folder, which claims whatever is left.
for _kind in (WEBDATASET, ZIP, TAR, LIST, FOLDER):
    register(_kind, first=False)
