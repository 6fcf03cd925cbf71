#!/usr/bin/env bash
# The images of docker-compose.yml, built with podman from docker/Dockerfile on a machine with or
# without an image registry (docs/deploy.md, "Building the images with podman"). The Makefile's
# container-deps, base-image and images targets call this with its variables in the environment.
#
#   docker/build_images.sh deps     podman runc debootstrap docker-compose (apt) + containers.conf
#   docker/build_images.sh base     localhost/debian-min:bookworm (debootstrap) -> PYTHON_IMAGE
#   docker/build_images.sh images   every target compose builds, checked inside, sizes printed, then
#                                   the untagged images of docker/Dockerfile removed (IMAGE_PRUNE)
#   docker/build_images.sh push     each built image to REGISTRY as recsys-<name>:VERSION, digests
#
# IMAGE_TAG (latest; compose's RECSYS_IMAGE_TAG), IMAGE_TARGETS (trainer torchserve gateway locust
# prometheus; torchserve-cuda too for the CUDA build), IMAGE_BASE (empty: python:3.11-slim when it can be
# pulled, else the local Debian base), TORCH_INDEX (auto: "none" = the hashed CPU wheel of pip's
# find-links when it is there, else download.pytorch.org's CPU index), FBGEMM, MIRROR (the Debian
# mirror; empty: the one apt's sources name), IMAGE_PRUNE (1; 0 keeps the build stages' layers).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${IMAGE_TAG:-latest}
TARGETS=${IMAGE_TARGETS:-trainer torchserve gateway locust prometheus}
DEBIAN_IMAGE=localhost/debian-min:bookworm
PYTHON_IMAGE=${PYTHON_IMAGE:-localhost/recsys-python:3.11}
UPSTREAM_BASE=docker.io/library/python:3.11-slim
LABEL=recsys-stack.built-from=docker/Dockerfile # docker/Dockerfile's LABEL: every stage carries it
PACKAGES=(podman runc debootstrap docker-compose catatonit docker-registry)
CONTAINERS_CONF='[containers]
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]
[engine]
runtime = "runc"'

die() {
	echo "error: $*" >&2
	exit 1
}
now() { date +%s; }

# "" as root, "sudo" with passwordless sudo; fails otherwise.
root_prefix() {
	if [ "$(id -u)" -eq 0 ]; then
		echo ""
	elif sudo -n true 2>/dev/null; then
		echo "sudo"
	else
		return 1
	fi
}

need_podman() {
	command -v podman >/dev/null || die "no podman: run 'make container-deps' (apt: ${PACKAGES[*]})"
}

deps() {
	local missing=() p sudo_
	for p in "${PACKAGES[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
	done
	if [ ${#missing[@]} -eq 0 ] && [ "$(cat /etc/containers/containers.conf 2>/dev/null)" = "$CONTAINERS_CONF" ]; then
		echo "container tools: ${PACKAGES[*]} and /etc/containers/containers.conf are in place"
		return
	fi
	sudo_=$(root_prefix) || die "container-deps needs root: run 'sudo make container-deps' (apt-get install -y ${PACKAGES[*]}, then /etc/containers/containers.conf as docs/deploy.md shows)"
	if [ ${#missing[@]} -gt 0 ]; then
		echo "installing ${missing[*]} (apt)"
		$sudo_ apt-get update -qq
		DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq "${missing[@]}" >/dev/null
	fi
	if [ "$(cat /etc/containers/containers.conf 2>/dev/null)" != "$CONTAINERS_CONF" ]; then
		# runc: crun refuses hybrid cgroup hosts; ulimits at or below the current ones (podman's
		# default raises them, which fails without CAP_SYS_RESOURCE).
		echo "writing /etc/containers/containers.conf (runtime runc, nofile/nproc 4096)"
		$sudo_ mkdir -p /etc/containers
		printf '%s\n' "$CONTAINERS_CONF" | $sudo_ tee /etc/containers/containers.conf >/dev/null
	fi
}

# The first non-security Debian mirror for bookworm in apt's sources (one-line or deb822 format).
debian_mirror() {
	local f
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
		[ -f "$f" ] || continue
		awk '
			/^deb / { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) { uri = $i; suite = $(i + 1); break }
				if (suite == "bookworm") { print uri; exit } }
			/^URIs:/ { uris = $2 }
			/^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "bookworm") ok = 1 }
			/^[[:space:]]*$/ { if (ok && uris) { print uris; exit } ok = 0; uris = "" }
			END { if (ok && uris) print uris }
		' "$f"
	done | head -1
}

base() {
	need_podman
	local sudo_ mirror rootfs ctx start
	start=$(now)
	if podman image exists "$DEBIAN_IMAGE"; then
		echo "$DEBIAN_IMAGE: already built"
	else
		command -v debootstrap >/dev/null || die "no debootstrap: run 'make container-deps'"
		sudo_=$(root_prefix) || die "debootstrap needs root: run 'sudo make base-image'"
		mirror=${MIRROR:-$(debian_mirror)}
		[ -n "$mirror" ] || die "no Debian bookworm mirror in /etc/apt/sources.list(.d): pass MIRROR=http://deb.debian.org/debian"
		rootfs=$(mktemp -d /var/tmp/debian-min.XXXXXX)
		trap '$sudo_ rm -rf "$rootfs"' EXIT
		echo "debootstrap --variant=minbase bookworm from $mirror"
		$sudo_ debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 ||
			die "debootstrap failed (log: $rootfs.log)"
		$sudo_ rm -rf "$rootfs.log" "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
		$sudo_ tar -C "$rootfs" -c . | podman import -q \
			--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
			--change 'CMD ["/bin/bash"]' - "$DEBIAN_IMAGE" >/dev/null
		$sudo_ rm -rf "$rootfs"
		trap - EXIT
	fi
	# What python:3.11-slim gives the Dockerfile: python3.11 with venv, the CA certificates.
	ctx=$(mktemp -d)
	cat >"$ctx/Containerfile" <<-EOF
		FROM $DEBIAN_IMAGE
		RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \\
		      python3 python3-venv ca-certificates >/dev/null \\
		 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
		CMD ["python3"]
	EOF
	podman build -q -t "$PYTHON_IMAGE" "$ctx" >/dev/null
	rm -rf "$ctx"
	echo "$PYTHON_IMAGE: $(size_mb "$PYTHON_IMAGE") MB ($DEBIAN_IMAGE: $(size_mb "$DEBIAN_IMAGE") MB), $(($(now) - start)) s"
}

size_mb() { echo $(($(podman image inspect --format '{{.Size}}' "$1") / 1000000)); }

# python:3.11-slim when it is there or can be pulled, else the Debian base (built when missing).
pick_base() {
	if podman image exists "$UPSTREAM_BASE" || timeout 120 podman pull -q "$UPSTREAM_BASE" >/dev/null 2>&1; then
		echo "$UPSTREAM_BASE"
		return
	fi
	echo "no $UPSTREAM_BASE (no registry reachable): the Debian base $PYTHON_IMAGE" >&2
	base >&2
	echo "$PYTHON_IMAGE"
}

# pip's find-links folders on this machine (PIP_FIND_LINKS, else `pip config`).
find_links() {
	local pip=.venv/bin/pip
	[ -x "$pip" ] || pip="python3 -m pip"
	if [ -n "${PIP_FIND_LINKS:-}" ]; then
		echo "$PIP_FIND_LINKS"
	else
		$pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.find-links='\(.*\)'$/\1/p" | head -1
	fi
}

# The build context: the files git tracks or would track (no caches, venvs, built objects).
make_context() {
	local ctx=$1
	if git rev-parse --git-dir >/dev/null 2>&1; then
		git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
			tar --null -T - -c | tar -x -C "$ctx"
		find "$ctx" -type d -exec touch -d @0 {} +
	else
		tar --exclude=.git -c . | tar -x -C "$ctx"
	fi
}

# Every module of the packages named after -c (but __main__; loadtest is the locust image's):
# the torch images hold only the train + serve lock, so a module needing anything else (a dev
# tool, locust) fails the check by name.
IMPORT_ALL='import importlib, pkgutil, sys
for top in sys.argv[1:]:
    for m in pkgutil.walk_packages(importlib.import_module(top).__path__, top + "."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)'

check() {
	local image=$1 target=$2
	case $target in
	gateway)
		podman run --rm --no-healthcheck "$image" python -c "import importlib.util as u, serving.gateway.wire as w; \
assert w._fastwire, 'no C decoder'; assert u.find_spec('torch') is None, 'torch in the gateway image'" &&
			podman run --rm --no-healthcheck "$image" python -m serving.gateway --help >/dev/null
		;;
	locust)
		podman run --rm --no-healthcheck "$image" python -c "import importlib.util as u, loadtest.locustfile; \
assert u.find_spec('torch') is None, 'torch in the locust image'" &&
			podman run --rm --no-healthcheck "$image" locust -f loadtest/locustfile.py --help >/dev/null
		;;
	torchserve*)
		podman run --rm --no-healthcheck "$image" torchserve --help >/dev/null &&
			podman run --rm --no-healthcheck "$image" python -c "import torch, fbgemm_gpu, torchrec, \
ts.torch_handler.base_handler, serving.worker.handler; $IMPORT_ALL" serving recsys_stack recsys_model
		;;
	prometheus)
		podman run --rm --no-healthcheck "$image" --version >/dev/null
		;;
	trainer)
		podman run --rm --no-healthcheck "$image" python -c "import torch, fbgemm_gpu, torchrec; \
$IMPORT_ALL" training serving recsys_stack recsys_model &&
			podman run --rm --no-healthcheck "$image" python -m training.train --help >/dev/null
		;;
	esac
}

images() {
	need_podman
	local start base links torch_index mounts=() d t target image args built=() failed=() t0
	start=$(now)
	base=${IMAGE_BASE:-$(pick_base)}
	links=$(find_links)
	torch_index=${TORCH_INDEX:-auto}
	if [ "$torch_index" = auto ]; then
		torch_index=https://download.pytorch.org/whl/cpu
		for d in $links; do
			compgen -G "$d/torch-2.13.0+cpu-*.whl" >/dev/null && torch_index=none
		done
	fi
	# pip inside the build sees what it sees here: the CA bundle (the registries are reached
	# through this machine's certificates) and the find-links folders, read-only at the same paths.
	ctx=$(mktemp -d)
	pipconf=$(mktemp)
	trap 'rm -rf "$ctx" "$pipconf"' EXIT # globals: the trap runs after images() returns
	make_context "$ctx"
	local ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
	{
		echo "[global]"
		[ -f "$ca" ] && echo "cert = $ca"
		[ -n "$links" ] && echo "find-links = $links"
	} >"$pipconf"
	chmod 644 "$pipconf"
	mounts+=(-v "$pipconf:/etc/pip.conf:ro")
	[ -f "$ca" ] && mounts+=(-v "$ca:$ca:ro")
	for d in $links; do [ -d "$d" ] && mounts+=(-v "$d:$d:ro"); done
	echo "base $base, torch from ${torch_index/none/find-links ($links), hashed (requirements/device-cpu.txt)}"
	for t in $TARGETS; do
		target=$t
		args=(--build-arg "BASE=$base" --build-arg "TORCH_INDEX=$torch_index")
		[ -n "${FBGEMM:-}" ] && args+=(--build-arg "FBGEMM=$FBGEMM")
		if [ "$t" = torchserve-cuda ]; then
			target=torchserve
			args=(--build-arg "BASE=$base" --build-arg TORCH_INDEX=https://pypi.org/simple --build-arg FBGEMM=fbgemm-gpu==1.8.0)
		fi
		case $target in trainer | torchserve | gateway | locust | prometheus) ;; *) die "unknown image target '$t' (trainer torchserve gateway locust prometheus torchserve-cuda)" ;; esac
		image=recsys-stack/$t:$TAG
		t0=$(now)
		echo "== $image (target $target)"
		if podman build --layers --format docker -f docker/Dockerfile --target "$target" "${args[@]}" "${mounts[@]}" -t "$image" "$ctx" &&
			check "$image" "$target"; then
			built+=("$image")
			echo "== $image: built and checked in $(($(now) - t0)) s"
		else
			failed+=("$image")
			echo "== $image: FAILED after $(($(now) - t0)) s" >&2
		fi
	done
	echo
	printf '%-38s %9s %14s\n' IMAGE "SIZE (MB)" "OVER BASE (MB)"
	local b
	b=$(size_mb "$base")
	printf '%-38s %9s %14s\n' "$base" "$b" "-"
	for image in "${built[@]}"; do
		printf '%-38s %9s %14s\n' "localhost/$image" "$(size_mb "$image")" "$(($(size_mb "$image") - b))"
	done
	[ ${#failed[@]} -eq 0 ] || die "not built: ${failed[*]} ($(($(now) - start)) s; build stages kept for the rerun)"
	[ "${IMAGE_PRUNE:-1}" = 0 ] || prune_stages
	echo "total $(($(now) - start)) s"
}

# The untagged images docker/Dockerfile made (its label), this build's or an earlier one's: the
# build stages no tagged image stands on (fastwire's compiler, gateway-venv's venv) and the
# images a rebuild replaced. `podman image prune` repeats until none is left, never takes an
# image a container uses, and leaves alone every image without the label (yours, the bases). The
# layers under the tagged images (runtime, python, torch-deps with the pip installs) stay: the
# next build reuses them and redoes only those two stages (IMAGE_PRUNE=0 keeps them too).
prune_stages() {
	local out n
	out=$(podman image prune -f --filter "label=$LABEL") || {
		echo "warning: podman image prune failed: the build stages stay (podman images shows them as <none>)" >&2
		return 0
	}
	n=$(printf '%s' "$out" | grep -c . || true)
	echo "removed $n untagged images of docker/Dockerfile (build stages, images a rebuild replaced)"
}

# Each image of TARGETS (recsys-stack/<t>:TAG, as `images` built it) tagged
# REGISTRY/recsys-<t>:VERSION and pushed; one line per image with the digest a cluster pulls by
# (REGISTRY/recsys-<t>@sha256:...). REGISTRY_TLS_VERIFY=false for a registry on plain HTTP.
push() {
	need_podman
	[ -n "${REGISTRY:-}" ] || die "REGISTRY is empty: make push REGISTRY=host:port (e.g. 127.0.0.1:5000)"
	[ -n "${VERSION:-}" ] || die "VERSION is empty (make push takes it from pyproject.toml)"
	local t image remote digest out
	out=$(mktemp -d)
	trap 'rm -rf "$out"' RETURN
	for t in $TARGETS; do
		image=recsys-stack/$t:$TAG
		podman image exists "$image" || die "$image not built: make images IMAGE_TARGETS=$t"
		remote=$REGISTRY/recsys-$t:$VERSION
		podman tag "$image" "$remote"
		podman push -q --tls-verify="${REGISTRY_TLS_VERIFY:-true}" --digestfile "$out/$t" "$remote" ||
			die "push of $remote failed (a plain-HTTP registry: REGISTRY_TLS_VERIFY=false)"
		digest=$(cat "$out/$t")
		echo "$remote  $REGISTRY/recsys-$t@$digest"
	done
	# docker-compose.yml names its images ${RECSYS_IMAGE_PREFIX}<target>:${RECSYS_IMAGE_TAG}
	local prometheus=""
	if [[ " $TARGETS " == *" prometheus "* ]]; then
		prometheus=" RECSYS_PROMETHEUS_IMAGE=$REGISTRY/recsys-prometheus:$VERSION"
	fi
	echo "compose: RECSYS_IMAGE_PREFIX=$REGISTRY/recsys- RECSYS_IMAGE_TAG=$VERSION$prometheus docker-compose pull, then up --no-build"
}

case ${1:-} in
deps) deps ;;
base) base ;;
images) images ;;
push) push ;;
*) die "usage: docker/build_images.sh deps|base|images|push" ;;
esac
