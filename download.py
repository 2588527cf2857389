"""Download one file over HTTP, resumably, retrying with backoff:
prepare_c4.py fetches its shards with it, prepare_shakespeare.py its text.

Design notes: docs/data.md
"""

import os
import re
import sys
import time

import requests
import urllib3
from tqdm import tqdm

from data import DataError

CHUNK_SIZE = 1 << 20  # download block
DEFAULT_RETRIES = 5
DEFAULT_RETRY_DELAY = 2.0  # seconds before the first retry, then doubled
MAX_RETRY_DELAY = 60.0
DEFAULT_TIMEOUT = 60.0  # seconds to connect, and between two blocks


class _Retryable(Exception):
    """A download failure that may well go away if we try again."""


def _parse_content_range(value):
    """'bytes START-END/TOTAL' -> (START, TOTAL);
    'bytes */TOTAL' -> (None, TOTAL)."""
    m = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+)\s*", value or "")
    if m is None:
        return None, None
    start, total = m.groups()
    return (int(start) if start else None), int(total)


def _fetch_into(url, part, timeout):
    """One attempt to bring ``part`` up to the full file."""
    have = os.path.getsize(part) if os.path.exists(part) else 0
    # the file's own bytes, never a server's re-compression of them
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    name = os.path.basename(part).removesuffix(".part")
    try:
        with requests.get(url, headers=headers, stream=True,
                          timeout=timeout) as resp:
            status = resp.status_code
            reply = resp.headers.get("Content-Range")
            if status == 416 and have:  # nothing left: is .part complete?
                if _parse_content_range(reply)[1] == have:
                    return
                os.remove(part)
                raise _Retryable(f"server refused to resume at byte "
                                 f"{have:,}; starting over")
            if status == 429 or status >= 500:
                raise _Retryable(f"HTTP {status} {resp.reason}")
            if status not in (200, 206):
                raise DataError(f"download of {url} failed: "
                                f"HTTP {status} {resp.reason}")
            if status == 206:
                start, total = _parse_content_range(reply)
                if start != have or total is None:
                    os.remove(part)
                    raise _Retryable("server resumed at the wrong offset; "
                                     "starting over")
                mode = "ab"
            else:  # 200: the whole file, asked for a range or not
                if have:
                    print(f"{name}: server ignored the resume request, "
                          "starting over")
                have, mode = 0, "wb"
                length = resp.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
            with open(part, mode) as f, tqdm(
                    total=total, initial=have, unit="B", unit_scale=True,
                    unit_divisor=1024, desc=name, leave=False) as bar:
                # the bytes as sent (no transparent decoding)
                for chunk in resp.raw.stream(CHUNK_SIZE,
                                             decode_content=False):
                    f.write(chunk)
                    have += len(chunk)
                    bar.update(len(chunk))
            if total is not None and have != total:
                raise _Retryable(f"connection closed after {have:,} "
                                 f"of {total:,} bytes")
    except (requests.ConnectionError, requests.Timeout,
            requests.exceptions.ChunkedEncodingError,
            urllib3.exceptions.HTTPError) as exc:
        raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
    except requests.RequestException as exc:  # a bad URL: retrying won't help
        raise DataError(f"download of {url} failed: {exc}") from exc
    except OSError as exc:
        raise DataError(f"could not write {part}: {exc}") from exc


def download(url, dest_path, retries=DEFAULT_RETRIES,
             retry_delay=DEFAULT_RETRY_DELAY, timeout=DEFAULT_TIMEOUT):
    """Download ``url`` to ``dest_path`` unless that file exists; return
    True if it downloaded. Up to ``retries`` retries, waiting
    ``retry_delay * 2**k`` seconds (at most MAX_RETRY_DELAY) before
    retry k+1."""
    if os.path.isfile(dest_path):
        return False
    os.makedirs(os.path.dirname(dest_path) or ".", exist_ok=True)
    part = dest_path + ".part"
    for attempt in range(retries + 1):
        try:
            _fetch_into(url, part, timeout)
            break
        except _Retryable as exc:
            if attempt == retries:
                kept = (f"; the partial download {part} is kept, rerun "
                        "to resume" if os.path.exists(part) else "")
                raise DataError(f"download of {url} failed after "
                                f"{attempt + 1} attempts: {exc}{kept}") \
                    from None
            delay = min(retry_delay * 2 ** attempt, MAX_RETRY_DELAY)
            print(f"{os.path.basename(dest_path)}: {exc}; "
                  f"retry {attempt + 1}/{retries} in {delay:.1f}s",
                  file=sys.stderr)
            time.sleep(delay)
    os.replace(part, dest_path)
    return True
