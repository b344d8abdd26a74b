"""The test S3 server (tests/s3server.py) does what the object-storage tests rely on: a real
server's answers to the S3 calls a push and a pull make, its refusal of wrong credentials, and
objects that outlive a stop and a start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# botocore is imported inside the tests: the fixtures skip when it is missing, a skip that
# fails under $CI (a module-level importorskip would skip at collection, which CI lets pass).


def _code(excinfo) -> tuple[str, int]:
    err = excinfo.value.response
    return err["Error"]["Code"], err["ResponseMetadata"]["HTTPStatusCode"]


def test_put_get_range_list_multipart_conditional(s3_server, s3_bucket):
    from botocore.exceptions import ClientError

    s3 = s3_server.client()
    s3.put_object(Bucket=s3_bucket, Key="cache/manifest.json", Body=b'{"format": "5.0"}')
    got = s3.get_object(Bucket=s3_bucket, Key="cache/manifest.json", Range="bytes=2-7")
    assert got["Body"].read() == b"format"
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206

    # a multipart upload of parts out of order, as parallel part uploads complete
    part = 5 * 2**20  # S3's least part size (all but the last)
    data = os.urandom(2 * part + 12345)
    up = s3.create_multipart_upload(Bucket=s3_bucket, Key="cache/data-0.bin")
    etags = {}
    for number in (3, 1, 2):
        body = data[(number - 1) * part : number * part]
        r = s3.upload_part(
            Bucket=s3_bucket,
            Key="cache/data-0.bin",
            UploadId=up["UploadId"],
            PartNumber=number,
            Body=body,
        )
        etags[number] = r["ETag"]
    s3.complete_multipart_upload(
        Bucket=s3_bucket,
        Key="cache/data-0.bin",
        UploadId=up["UploadId"],
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in (1, 2, 3)]},
    )
    assert s3.head_object(Bucket=s3_bucket, Key="cache/data-0.bin")["ContentLength"] == len(data)
    lo, hi = part - 100, 2 * part + 99  # across both part boundaries
    got = s3.get_object(Bucket=s3_bucket, Key="cache/data-0.bin", Range=f"bytes={lo}-{hi}")
    assert got["Body"].read() == data[lo : hi + 1]

    listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix="cache/")
    assert sorted(o["Key"] for o in listed["Contents"]) == [
        "cache/data-0.bin",
        "cache/manifest.json",
    ]

    # a conditional PUT (If-None-Match: *): the one way to claim a name without a race
    with pytest.raises(ClientError) as excinfo:
        s3.put_object(Bucket=s3_bucket, Key="cache/manifest.json", Body=b"other", IfNoneMatch="*")
    assert _code(excinfo) == ("PreconditionFailed", 412)
    assert s3.get_object(Bucket=s3_bucket, Key="cache/manifest.json")["Body"].read()[:2] == b'{"'


def test_credentials_from_the_environment_and_wrong_ones_refused(s3_server, s3_bucket):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import ClientError

    s3_server.client().put_object(Bucket=s3_bucket, Key="k", Body=b"value")

    # a subprocess that names nothing but what env() sets, as a user's shell would
    script = (
        "import boto3, json, sys; s3 = boto3.client('s3');"
        "print(json.dumps(s3.get_object(Bucket=sys.argv[1], Key='k')['Body'].read().decode()))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env(), AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    done = subprocess.run(
        [sys.executable, "-c", script, s3_bucket], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == "value"

    with pytest.raises(ClientError) as excinfo:
        s3_server.client(secret_key="not-the-secret").get_object(Bucket=s3_bucket, Key="k")
    assert _code(excinfo) == ("SignatureDoesNotMatch", 403)

    unknown = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint_url,
        aws_access_key_id="no-such-key",
        aws_secret_access_key=s3_server.secret_key,
        region_name=s3_server.region,
    )
    with pytest.raises(ClientError) as excinfo:
        unknown.get_object(Bucket=s3_bucket, Key="k")
    assert _code(excinfo) == ("InvalidAccessKeyId", 403)

    anonymous = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint_url,
        region_name=s3_server.region,
        config=Config(signature_version=UNSIGNED),
    )
    with pytest.raises(ClientError) as excinfo:
        anonymous.get_object(Bucket=s3_bucket, Key="k")
    assert _code(excinfo) == ("AccessDenied", 403)


def test_the_engines_tool_runs_at_a_tiny_size(weed, tmp_path):
    # tools/s3_engines.py starts a server of its own; boto3 alone (the others are not in the
    # dev extra, and obstore's fork probes would wait out their 20 s bound)
    tool = Path(__file__).resolve().parents[1] / "tools" / "s3_engines.py"
    run = subprocess.run(
        [sys.executable, str(tool), "--mib", "40", "--repeat", "1", "--engines", "boto3"],
        cwd=tmp_path,  # (its server's folder is a temporary one it removes)
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = {line.split("  ")[0]: line for line in run.stdout.splitlines()}
    assert {"boto3 client per thread", "boto3 shared client"} <= set(rows), run.stdout
    assert rows["boto3 shared client"].split()[-2:] == ["ok", "ok"], run.stdout
