"""Modules the scripts of tools/ import: split out of a tool or shared by several, not tools."""
