"""Rewrite a wheel without some of its folders, as a valid wheel (RECORD rewritten to match).

Used by build_bundle.sh on ray's wheel (79 MB), whose Java jar, dashboard web client and libraries
we never import (rllib, data, serve, tune, train, llm) would put the bundle over what one device
call carries. File modes are kept, so pip installs raylet and gcs_server executable.

    python slim_wheel.py IN.whl OUT.whl PREFIX [PREFIX ...]
"""
from __future__ import annotations

import base64
import hashlib
import sys
import zipfile


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(src: str, dst: str, drop: list[str]) -> tuple[int, int]:
    """Copy `src` to `dst` leaving out every member under a prefix of `drop`; returns (kept, dropped)."""
    kept = dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in zin.infolist():
            if info.filename == record_name:
                continue
            if any(info.filename.startswith(p.rstrip("/") + "/") for p in drop):
                dropped += 1
                continue
            data = zin.read(info)
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            out.external_attr = info.external_attr  # keeps the executable bits
            out.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(out, data, compresslevel=9)
            lines.append(_record_line(info.filename, data))
            kept += 1
        lines.append(f"{record_name},,")
        record = zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0))
        record.external_attr = 0o644 << 16
        zout.writestr(record, "\n".join(lines) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    return kept, dropped


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: slim_wheel.py IN.whl OUT.whl PREFIX [PREFIX ...]")
    kept, dropped = slim(sys.argv[1], sys.argv[2], sys.argv[3:])
    print(f"slim_wheel: {sys.argv[2]}: kept {kept} files, dropped {dropped}")
