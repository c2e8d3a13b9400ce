"""Where uploaded files' bytes live, behind one interface: a local directory (embedded) or an
S3-compatible object store through boto3 (at scale), which also hands out pre-signed upload URLs
so large files go from the client straight to the store, never through a gateway."""

from __future__ import annotations

import asyncio
import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

_SAFE_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,255}$")


def check_key(key: str) -> str:
    if not _SAFE_KEY.match(key) or ".." in key:
        raise ValueError(f"unsafe object key {key!r}")
    return key


class ObjectStore(ABC):
    presigned: bool = False  # whether presign_put() works

    @abstractmethod
    async def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None: ...

    @abstractmethod
    async def get(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes; FileNotFoundError if missing; ValueError past max_bytes."""

    @abstractmethod
    async def size(self, key: str) -> int | None:
        """The object's size, None if it is not there."""

    @abstractmethod
    async def delete(self, key: str) -> None: ...

    def presign_put(self, key: str, content_type: str, expires_s: int = 900) -> str:
        raise NotImplementedError("this store takes uploads through the gateway only")

    def access_url(self, key: str, fallback: str, expires_s: int = 900) -> str:
        """A URL the owner can fetch the bytes from (the gateway's own content route by default)."""
        return fallback

    async def close(self) -> None:
        return None


class LocalObjectStore(ObjectStore):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        def write() -> None:
            path = self._path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".part")
            tmp.write_bytes(data)
            tmp.replace(path)  # readers never see half a file

        await asyncio.to_thread(write)

    async def get(self, key: str, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        if max_bytes is not None and path.is_file() and path.stat().st_size > max_bytes:
            raise ValueError(f"object {key} is over {max_bytes} bytes")
        return await asyncio.to_thread(path.read_bytes)

    async def size(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path.is_file() else None

    async def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class S3ObjectStore(ObjectStore):
    """boto3's client, its blocking calls run in threads."""

    presigned = True

    def __init__(self, bucket: str, endpoint_url: str | None = None, create_bucket: bool = False,
                 **client_options: Any) -> None:
        import boto3  # the `s3` extra: imported only where this store is used

        self.bucket = bucket
        self.client = boto3.client("s3", endpoint_url=endpoint_url, **client_options)
        self._create = create_bucket

    async def init(self) -> None:
        if self._create:
            from botocore.exceptions import ClientError

            try:
                await asyncio.to_thread(self.client.create_bucket, Bucket=self.bucket)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    async def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        await asyncio.to_thread(self.client.put_object, Bucket=self.bucket, Key=check_key(key), Body=data,
                                ContentType=content_type)

    async def get(self, key: str, max_bytes: int | None = None) -> bytes:
        from botocore.exceptions import ClientError

        try:
            got = await asyncio.to_thread(self.client.get_object, Bucket=self.bucket, Key=check_key(key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from None
            raise
        if max_bytes is not None and got["ContentLength"] > max_bytes:
            got["Body"].close()
            raise ValueError(f"object {key} is over {max_bytes} bytes")
        return await asyncio.to_thread(got["Body"].read)

    async def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            head = await asyncio.to_thread(self.client.head_object, Bucket=self.bucket, Key=check_key(key))
        except ClientError:
            return None
        return int(head["ContentLength"])

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self.client.delete_object, Bucket=self.bucket, Key=check_key(key))

    def presign_put(self, key: str, content_type: str, expires_s: int = 900) -> str:
        return self.client.generate_presigned_url(
            "put_object", Params={"Bucket": self.bucket, "Key": check_key(key), "ContentType": content_type},
            ExpiresIn=expires_s)

    def access_url(self, key: str, fallback: str, expires_s: int = 900) -> str:
        return self.client.generate_presigned_url("get_object", Params={"Bucket": self.bucket, "Key": check_key(key)},
                                                  ExpiresIn=expires_s)


def make_object_store(url: str | None) -> ObjectStore:
    """"s3://bucket" (endpoint from AWS_ENDPOINT_URL / the AWS config) or a directory path;
    None: ./.fairway/files."""
    if url and url.startswith("s3://"):
        return S3ObjectStore(url[len("s3://"):].strip("/"), endpoint_url=os.environ.get("AWS_ENDPOINT_URL"))
    return LocalObjectStore(url or Path(".fairway") / "files")
