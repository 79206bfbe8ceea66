"""An IAM role assumed for an ``s3://`` source (the spec's ``AWS_ASSUME_ROLE`` and ``AWS_OIDC``),
through botocore's own fetchers, as the engine's credential provider.

``AWS_ASSUME_ROLE``: STS ``AssumeRole``, signed with the credentials found otherwise (a secret's
keys, the environment's, botocore's chain); ``AWS_OIDC``: ``AssumeRoleWithWebIdentity`` with the
token of ``AWS_WEB_IDENTITY_TOKEN_FILE`` (read again at each refresh: the file is rotated by
whoever writes it). What STS gives is asked for again before it expires. STS is reached as
botocore reaches it: in the role's region, or where ``AWS_ENDPOINT_URL_STS`` or
``AWS_ENDPOINT_URL`` (or the profile) say, trusting ``AWS_CA_BUNDLE``, through the proxies.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timezone
from typing import TYPE_CHECKING, Any

from bt_agent.errors import AccessDeniedError, StoreError, TransientStoreError
from bt_agent.storage.credentials import AwsRole

if TYPE_CHECKING:
    from obstore.store import S3Credential

#: Seconds STS may take to connect, and to answer, each time a role is assumed.
STS_TIMEOUT_SECONDS = 10


def engine_credential(credentials: Any) -> S3Credential:
    """botocore's credentials (refreshed by botocore where they are about to expire) in the
    engine's form, with when they expire where they do, so that the engine asks again then."""
    frozen = credentials.get_frozen_credentials()
    expiry = getattr(credentials, "_expiry_time", None)  # refreshable ones have it
    return {
        "access_key_id": frozen.access_key,
        "secret_access_key": frozen.secret_key,
        "token": frozen.token,
        "expires_at": expiry.astimezone(timezone.utc) if expiry else None,
    }


class RoleCredentials:
    """The credentials of ``role``, assumed with those ``source`` gives (``AWS_ASSUME_ROLE``)
    or with the web identity token (``AWS_OIDC``)."""

    def __init__(
        self,
        uri: str,
        role: AwsRole,
        source: Callable[[], S3Credential],
        ca_bundle: str | None = None,
    ) -> None:
        from botocore.credentials import (
            AssumeRoleCredentialFetcher,
            AssumeRoleWithWebIdentityCredentialFetcher,
            DeferredRefreshableCredentials,
            FileWebIdentityTokenLoader,
        )

        self.uri, self.role, self.ca_bundle = uri, role, ca_bundle
        asked = {"RoleSessionName": role.session_name}
        fetcher: Any
        if role.web_identity:
            if not role.token_file:
                raise AccessDeniedError(
                    f"{uri}: auth_method AWS_OIDC needs a web identity token to assume "
                    f"{role.arn}; set AWS_WEB_IDENTITY_TOKEN_FILE to the file of an OIDC token "
                    "the role trusts",
                    uri,
                )
            token = FileWebIdentityTokenLoader(role.token_file)
            fetcher = AssumeRoleWithWebIdentityCredentialFetcher(
                self._client, token, role.arn, asked
            )
        else:
            fetcher = AssumeRoleCredentialFetcher(self._client, _Frozen(source), role.arn, asked)
        self.credentials = DeferredRefreshableCredentials(
            fetcher.fetch_credentials,
            "assume-role-with-web-identity" if role.web_identity else "assume-role",
        )

    def _client(self, service: str, **given: Any) -> Any:
        """The STS client botocore's fetchers ask for, made as botocore makes it, in the role's
        region, with short timeouts and the CA bundle of the store."""
        import botocore.session
        from botocore.config import Config

        config = Config(
            connect_timeout=STS_TIMEOUT_SECONDS,
            read_timeout=STS_TIMEOUT_SECONDS,
            retries={"mode": "standard"},
        )
        if (asked := given.pop("config", None)) is not None:  # the web identity's: unsigned
            config = config.merge(asked)
        return botocore.session.get_session().create_client(
            service,
            region_name=self.role.region,
            verify=self.ca_bundle or None,
            config=config,
            **given,
        )

    def __call__(self) -> S3Credential:
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

        try:
            return engine_credential(self.credentials)
        except StoreError:  # the source's: no credentials to assume the role with
            raise
        except ClientError as exc:  # STS refused
            error = exc.response.get("Error", {})
            said = f"{error.get('Code', 'refused')}: {error.get('Message', '')}".rstrip(": ")
            refused = f"{self._cannot()} ({said}); {self._hint()}"
            raise AccessDeniedError(refused, self.uri) from None
        except EndpointConnectionError as exc:  # an outage (asked again), or a name mistyped
            from bt_agent.storage.tls import unknown_host  # ssl's import: on failure only

            if unknown := unknown_host(exc, exc.kwargs.get("endpoint_url", "")):
                raise AccessDeniedError(f"{self._cannot()}: {unknown}", self.uri) from None
            raise TransientStoreError(f"{self._cannot()} ({exc})", self.uri) from None
        except (BotoCoreError, OSError) as exc:  # no token file, no source credentials, TLS
            raise AccessDeniedError(f"{self._cannot()} ({exc})", self.uri) from None

    def _cannot(self) -> str:
        return f"{self.uri}: cannot assume the role {self.role.arn} ({self.role.method})"

    def _hint(self) -> str:
        if self.role.web_identity:
            return (
                "check the role's ARN, and that its trust policy allows "
                "sts:AssumeRoleWithWebIdentity for the token's issuer, audience and subject"
            )
        return (
            "check the role's ARN, and that its trust policy allows sts:AssumeRole for the "
            "credentials it is assumed with (AWS_ACCESS_KEY_ID, the profile, the instance's role)"
        )


class _Frozen:
    """Credentials of the engine's form as botocore's fetchers take them: asked for at each
    assumption, so that refreshed source credentials are used."""

    def __init__(self, source: Callable[[], S3Credential]) -> None:
        self.source = source

    def get_frozen_credentials(self) -> Any:
        from botocore.credentials import Credentials

        given = self.source()
        keys = Credentials(given["access_key_id"], given["secret_access_key"], given.get("token"))
        return keys.get_frozen_credentials()
