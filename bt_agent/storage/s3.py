"""``s3://bucket/prefix`` (and ``r2://``, ``cw://``, any S3-compatible endpoint) on obstore
(:mod:`bt_agent.storage.engine`).

What is S3's own: the endpoint (``AWS_ENDPOINT_URL(_S3)`` or the engine's ``AWS_ENDPOINT``, else the
profile's, else AWS's in the region's partition, its FIPS or dual-stack endpoint where
``AWS_USE_FIPS_ENDPOINT`` or ``AWS_USE_DUALSTACK_ENDPOINT`` or the profile asks for one, a directory
bucket's zonal endpoint for S3 Express One Zone), the region, and the credentials: the keys of a
secret or of the environment as they are (botocore, slow to import, is not, unless the shared config
file names a setting of the endpoint), else botocore's own chain (profiles, SSO, web identity,
container and instance roles, ``credential_process``), asked again before what it gave expires;
where the spec names an IAM role, the role assumed with them (:mod:`roles`). Either way the engine
gets them through its credential provider, so that no variable of the environment is mixed into a
secret's keys. Every request with a body carries its SHA-256 checksum (the engine's
``checksum_algorithm``), which the service verifies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bt_agent.errors import AccessDeniedError, StoreError
from bt_agent.storage.credentials import AwsRole, S3Keys
from bt_agent.storage.engine import ENGINE_RETRIES, EngineStore, Proxies, Tuning
from bt_agent.storage.roles import RoleCredentials, engine_credential

if TYPE_CHECKING:
    from obstore.store import S3Credential

#: The largest object one CopyObject takes.
MAX_COPY_BYTES = 5 * 1024**3
CA_BUNDLE_VARIABLE = "AWS_CA_BUNDLE"
#: Where AWS answers which region holds a bucket (:func:`bucket_region`).
REGION_ENDPOINT = "https://s3.amazonaws.com"
#: How a directory bucket of S3 Express One Zone is named: ``<base>--<zone id>--x-s3``.
EXPRESS_SUFFIX = "--x-s3"
#: Seconds each request of :meth:`S3Store.abort_uploads` may take to connect, and to answer: it
#: runs as a drain ends, within what is left of a grace period.
CLEANUP_TIMEOUT_SECONDS = 2.0
#: The domains of AWS's partitions whose regions are not in ``amazonaws.com``, by the start of
#: their regions' names (botocore's ``partitions.json``; its isolated partitions left out).
PARTITION_DOMAINS = (("cn-", "amazonaws.com.cn"), ("eusc-", "amazonaws.eu"))
#: What a shared config file may say of where S3's requests go and whom they trust, beside keys
#: and a region: a file that names none of these is not read through botocore where the keys
#: and the region are known already (:func:`names_endpoint_settings`).
ENDPOINT_SETTINGS = (
    "endpoint_url",
    "ca_bundle",
    "use_fips_endpoint",
    "use_dualstack_endpoint",
    "addressing_style",
)


class S3Store(EngineStore):
    max_copy_bytes = MAX_COPY_BYTES
    ca_variable = CA_BUNDLE_VARIABLE

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        url: str | None = None,
        endpoint_url: str | None = None,
        keys: S3Keys | None = None,
        region: str | None = None,
        tuning: Tuning | None = None,
        ca_bundle: str | None = None,
        proxies: Proxies | None = None,
        fips: bool | None = None,
        dualstack: bool | None = None,
        virtual_hosted: bool = False,
        shared_config: str | None = None,
        missing_hint: str = "",
        role: AwsRole | None = None,
    ) -> None:
        """``fips`` and ``dualstack``: whether to use AWS's FIPS and dual-stack (IPv6)
        endpoints; None where the environment does not say (then the profile may).
        ``virtual_hosted``: the bucket is named in the endpoint's host
        (``https://<bucket>.<endpoint host>``), for services that take no other form; a
        profile's ``addressing_style = virtual`` asks for it too. ``shared_config``: the path
        of the shared config file, read through botocore even where keys and a region are
        given if it names one of :data:`ENDPOINT_SETTINGS`, as botocore reads it then too.
        ``missing_hint``: where else a bucket the endpoint does not hold may be, said where it
        does not (``; ...``). ``role``: an IAM role to assume with the credentials found (or
        with a web identity token), whose credentials the engine is given."""
        prefix = prefix.strip("/")
        super().__init__(
            prefix,
            url or f"s3://{bucket}" + (f"/{prefix}" if prefix else ""),
            endpoint_url,
            tuning,
            ca_bundle,
            proxies,
        )
        self.bucket = bucket
        self.keys = keys
        self.region = region or (keys.region if keys else None)
        self.role = role
        self.fips, self.dualstack = fips, dualstack
        self.virtual_hosted = virtual_hosted
        self.signing_region = self.region  # the region requests are signed for, once known
        self.shared_config = shared_config
        self.missing_hint = missing_hint
        self._credentials: Callable[[], S3Credential] | None = None  # the engine's, once made

    def own_endpoint(self) -> str:
        """A directory bucket's zonal endpoint, which the engine finds from its name (every
        other endpoint is given to the engine)."""
        if not self.bucket.endswith(EXPRESS_SUFFIX):
            return super().own_endpoint()
        zone = self.bucket.removesuffix(EXPRESS_SUFFIX).rpartition("--")[2]
        return f"https://{self.bucket}.s3express-{zone}.{self.signing_region}.amazonaws.com"

    def other_region(self, region: str | None) -> str:
        named = (
            f"its region, {region}"
            if region
            else f"its region (aws s3api head-bucket --bucket {self.bucket} names it)"
        )
        return (
            f"the bucket {self.bucket} is not in the region {self.signing_region}, which "
            f"requests are signed for; set AWS_DEFAULT_REGION (or the secret's aws_region) to "
            f"{named}"
        )

    def _make_engine(self) -> Any:
        from obstore.store import S3Store as Engine

        config: dict[str, Any] = {}
        keys: Callable[[], S3Credential] | None = _Keys(self.keys) if self.keys else None
        region = self.region
        fips, dualstack = self.fips, self.dualstack
        if keys is None or region is None or names_endpoint_settings(self.shared_config):
            chain = _BotocoreChain(self.uri())
            keys = keys or chain
            region = region or chain.region()
            self.endpoint_url = self.endpoint_url or chain.endpoint_url()
            self.ca_bundle = self.ca_bundle or chain.ca_bundle()
            fips = chain.flag("use_fips_endpoint") if fips is None else fips
            dualstack = chain.flag("use_dualstack_endpoint") if dualstack is None else dualstack
            self.virtual_hosted = self.virtual_hosted or chain.addressing_style() == "virtual"
        express = not self.endpoint_url and self.bucket.endswith(EXPRESS_SUFFIX)
        if region is None and not self.endpoint_url and not express:  # AWS, no region set
            region = bucket_region(self.bucket, self.ca_bundle, self.proxy(), REGION_ENDPOINT)
        self.region = self.signing_region = region = region or "us-east-1"  # kept for a remake
        if express:
            config["s3_express"] = True  # the engine finds the zone's endpoint and sessions
        else:
            self.endpoint_url = self.endpoint_url or aws_endpoint(region, fips, dualstack)
        if self.endpoint_url:
            if self.virtual_hosted:
                self.endpoint_url = bucket_endpoint(self.endpoint_url, self.bucket)
            config.update(endpoint=self.endpoint_url)
        config["virtual_hosted_style_request"] = self.virtual_hosted
        if self.role is not None:
            keys = RoleCredentials(self.uri(), self.role, keys, self.ca_bundle)
        self._credentials = keys
        return Engine(
            self.bucket,
            region=region,
            checksum_algorithm="sha256",
            credential_provider=keys,
            client_options=self._client_options(),
            retry_config=ENGINE_RETRIES,
            **config,
        )

    def abort_uploads(self, prefix: str) -> int:
        """Multipart uploads begun under ``prefix`` and never completed, aborted: S3 keeps
        their parts out of sight, and bills them, until then, and the engine aborts only those
        that fail (not those of a process that ends with them under way). Through botocore
        (the engine has no such calls), with short timeouts. A part still on its way as its
        upload is aborted may land after it; the next abort takes it (after
        :meth:`wait_uploads`)."""
        from botocore.exceptions import BotoCoreError, ClientError

        if self.bucket.endswith(EXPRESS_SUFFIX):
            return 0  # directory buckets: only their lifecycle rule reclaims such uploads
        under = self._key(prefix)  # the store's own prefix, with its slash, for ""
        client = self._cleanup_client()
        aborted = 0
        try:
            pages = client.get_paginator("list_multipart_uploads")
            for page in pages.paginate(Bucket=self.bucket, Prefix=under):
                for upload in page.get("Uploads", []):
                    with contextlib.suppress(ClientError):  # aborted meanwhile: NoSuchUpload
                        client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        aborted += 1
        except (BotoCoreError, ClientError) as exc:
            raise StoreError(
                f"{self.uri(prefix)}: cannot abort the multipart uploads left there ({exc}); "
                "a lifecycle rule (AbortIncompleteMultipartUpload) reclaims them",
                self.uri(prefix),
            ) from None
        finally:
            client.close()
        return aborted

    def _cleanup_client(self) -> Any:
        """A botocore client made as the engine is: its endpoint, region, credentials, CA
        bundle and proxy."""
        import botocore.session
        from botocore.config import Config

        _ = self.engine  # endpoint, region and credentials resolved
        assert self._credentials is not None  # made with the engine
        credential = self._credentials()
        endpoint = self.endpoint_url
        if endpoint and self.virtual_hosted:
            endpoint = path_endpoint(endpoint, self.bucket)
        style = "virtual" if self.virtual_hosted else "path" if endpoint else "auto"
        proxy = self.proxy()
        config = Config(
            connect_timeout=CLEANUP_TIMEOUT_SECONDS,
            read_timeout=CLEANUP_TIMEOUT_SECONDS,
            retries={"total_max_attempts": 2},
            proxies={"https": proxy, "http": proxy} if proxy else None,
            s3={"addressing_style": style},
        )
        return botocore.session.get_session().create_client(
            "s3",
            self.signing_region,
            endpoint_url=endpoint,
            verify=self.ca_bundle or None,
            aws_access_key_id=credential["access_key_id"],
            aws_secret_access_key=credential["secret_access_key"],
            aws_session_token=credential["token"],
            config=config,
        )


def names_endpoint_settings(path: str | None) -> bool:
    """Whether the shared config file at ``path`` names one of :data:`ENDPOINT_SETTINGS` (in any
    profile: the file is not parsed, only looked through); False where there is no such file."""
    if not path:
        return False
    try:
        with open(path, "rb") as config:
            text = config.read()
    except OSError:
        return False
    return any(name.encode() in text for name in ENDPOINT_SETTINGS)


def bucket_region(
    bucket: str, ca_bundle: str | None, proxy: str | None, endpoint: str
) -> str | None:
    """The region AWS (at ``endpoint``) says holds ``bucket``: the ``x-amz-bucket-region``
    header of its answer to a HEAD of the bucket, which it gives to anyone, as botocore's
    region redirects read it (the engine has no such lookup, and its requests to the wrong
    region fail). None where no answer says it (no such bucket; AWS out of reach: requests then
    go to ``us-east-1``)."""
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    config = Config(
        signature_version=UNSIGNED,
        connect_timeout=5,
        read_timeout=10,
        retries={"total_max_attempts": 2},
        proxies={"https": proxy, "http": proxy} if proxy else None,
    )
    client = botocore.session.get_session().create_client(
        "s3", "us-east-1", endpoint_url=endpoint, verify=ca_bundle or None, config=config
    )
    try:
        answer: Any = client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        answer = exc.response
    except BotoCoreError:
        return None
    finally:
        client.close()
    region = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
    return str(region) if region else None


def bucket_endpoint(endpoint: str, bucket: str) -> str:
    """``endpoint`` with ``bucket`` as the first label of its host (virtual-hosted style), as it
    is where it has that label already (a store's engine made again after ``close``)."""
    scheme, _, rest = endpoint.partition("://")
    rest = rest.rstrip("/")
    return endpoint if rest.startswith(f"{bucket}.") else f"{scheme}://{bucket}.{rest}"


def path_endpoint(endpoint: str, bucket: str) -> str:
    """``endpoint`` without ``bucket`` as the first label of its host: the inverse of
    :func:`bucket_endpoint`."""
    scheme, _, rest = endpoint.partition("://")
    return f"{scheme}://{rest.removeprefix(f'{bucket}.')}"


def aws_endpoint(region: str, fips: bool | None, dualstack: bool | None) -> str:
    """S3's endpoint in ``region``, or the FIPS or dual-stack (IPv6) one where asked for, named
    as botocore names it: in the domain of the region's partition (the engine's own endpoint
    is in ``amazonaws.com`` for every region, which China's are not)."""
    host = ("s3-fips" if fips else "s3") + (".dualstack" if dualstack else "")
    domain = next(
        (domain for prefix, domain in PARTITION_DOMAINS if region.startswith(prefix)),
        "amazonaws.com",
    )
    return f"https://{host}.{region}.{domain}"


class _Keys:
    """Keys given as they are (a secret's, or the environment's), as a credential provider."""

    def __init__(self, keys: S3Keys) -> None:
        self.keys = keys

    def __call__(self) -> S3Credential:
        return {
            "access_key_id": self.keys.access_key_id,
            "secret_access_key": self.keys.secret_access_key,
            "token": self.keys.session_token,
            "expires_at": None,
        }


class _BotocoreChain:
    """botocore's credential chain as the engine's credential provider: environment, shared
    config and profiles, SSO, web identity, container and instance metadata; refreshable
    credentials are asked again before they expire."""

    def __init__(self, uri: str) -> None:
        import botocore.session
        from botocore.exceptions import BotoCoreError

        self.uri = uri
        self.session = botocore.session.get_session()
        self.credentials: Any = None
        try:
            self.session.get_scoped_config()  # the files read and the profile found, once
        except BotoCoreError as exc:  # a profile named that is not there, a file unreadable
            raise StoreError(
                f"{uri}: the AWS configuration cannot be used ({exc}); check AWS_PROFILE and "
                "the files AWS_CONFIG_FILE and AWS_SHARED_CREDENTIALS_FILE name (by default "
                "~/.aws/config and ~/.aws/credentials)",
                uri,
            ) from None

    def region(self) -> str | None:
        region: str | None = self.session.get_config_variable("region")
        return region

    def ca_bundle(self) -> str | None:
        """A profile's ``ca_bundle``."""
        found: str | None = self.session.get_config_variable("ca_bundle")
        return found

    def endpoint_url(self) -> str | None:
        """The shared config's endpoint of S3 for the profile, as botocore finds it: the ``s3``
        subsection of the ``services`` section the profile names, else the profile's own
        ``endpoint_url`` (an ``s3`` subsection of the profile first, the form of the AWS CLI's
        endpoint plugin); none where ``ignore_configured_endpoint_urls`` is set."""
        if self.flag("ignore_configured_endpoint_urls"):
            return None
        scoped = self.session.get_scoped_config()
        sections = self.session.full_config.get("services", {})
        named = sections.get(scoped.get("services"), {})
        for service in (named.get("s3"), scoped.get("s3")):
            if isinstance(service, dict) and service.get("endpoint_url"):
                return str(service["endpoint_url"])
        endpoint = scoped.get("endpoint_url")
        return str(endpoint) if endpoint else None

    def addressing_style(self) -> str | None:
        """The profile's ``s3`` section's ``addressing_style`` (``virtual``, ``path``, ``auto``)."""
        service = self.session.get_scoped_config().get("s3")
        style = service.get("addressing_style") if isinstance(service, dict) else None
        return str(style) if style else None

    def flag(self, name: str) -> bool:
        """A yes-or-no setting of the environment or the profile (or its ``s3`` section)."""
        value = self.session.get_config_variable(name)
        if value is None:
            service = self.session.get_scoped_config().get("s3")
            value = service.get(name) if isinstance(service, dict) else None
        return str(value).lower() == "true"

    def __call__(self) -> S3Credential:
        if self.credentials is None:
            self.credentials = self.session.get_credentials()
        if self.credentials is None:
            raise AccessDeniedError(
                f"{self.uri}: no credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "use a profile (AWS_PROFILE), or name a secret",
                self.uri,
            )
        return engine_credential(self.credentials)
