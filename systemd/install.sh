#!/usr/bin/env bash
# Install meshd as a systemd service, the way systemd/README.md documents it.
#
#   first device:   sudo systemd/install.sh --new-home "Our flat" [--key home-assistant --http 0.0.0.0:11434]
#   other devices:  sudo systemd/install.sh --token meshd1-...      (token: `meshd invite` on a member)
#   re-install:     sudo systemd/install.sh                          (the state dir already holds a home)
#
# Steps: a virtual environment with meshd (and its reference profiles), a `meshd`
# system user, the state directory /var/lib/meshd that holds the state *and* the
# model cache (MESHD_HOME, the same for the service and every command below),
# the model, /etc/meshd/meshd.toml, the home (created or joined, then the command
# exits: `meshd join --setup-only`), an API key, the unit (+ the GPU drop-in),
# `systemd-analyze verify`, then `systemctl enable meshd && systemctl restart meshd`.
#
# --prefix DIR installs everything under DIR as the calling user instead (no user,
# no chown, nothing started): what the tests run, and a way to look before installing.
set -euo pipefail

unset PYTHONPATH  # the service runs without it: so does every step here
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"

usage() {
    cat <<'EOF'
usage: install.sh [--new-home NAME | --token TOKEN] [options]

  --new-home NAME     create a home with this device as its first member
  --token TOKEN       join a home with a token from `meshd invite` on a member
                      (neither: the state directory must already hold a home)
  --name NAME         this device's name (default: the host name)
  --key NAME          create an API key NAME for the LAN listener and print it (once)
  --http HOST:PORT    serve the API (OpenAI + Ollama) on TCP, e.g. 0.0.0.0:11434
  --model NAME        pull this catalog model and serve it (default: the embedded model)
  --model-from DIR    copy DIR/*.gguf into the model cache instead of downloading
  --no-pull           fetch no model now (a member without one fetches its layers from the home)
  --gpu               install the GPU drop-in (meshd.service.d/gpu.conf)
  --source PATH       what to pip-install: a wheel or a source tree (default: this checkout)
  --venv DIR          the virtual environment (default /opt/meshd; an existing one is reused)
  --python PY         interpreter for a new venv (default python3, 3.11 or newer)
  --pip-args ARGS     pip install options (default for this checkout: -c constraints.txt)
  --no-start          install and set up, but do not enable or start the service
  --prefix DIR        install under DIR as this user: no user, no chown, nothing started
EOF
}

new_home="" token="" name="" key="" http="" model="" model_from="" no_pull=0 gpu=0
source_path="$repo" venv="" python="python3" pip_args="" pip_args_set=0 start=1 prefix=""
while [ $# -gt 0 ]; do
    case "$1" in
        --new-home) new_home="$2"; shift 2 ;;
        --token) token="$2"; shift 2 ;;
        --name) name="$2"; shift 2 ;;
        --key) key="$2"; shift 2 ;;
        --http) http="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
        --model-from) model_from="$2"; shift 2 ;;
        --no-pull) no_pull=1; shift ;;
        --gpu) gpu=1; shift ;;
        --source) source_path="$2"; shift 2 ;;
        --venv) venv="$2"; shift 2 ;;
        --python) python="$2"; shift 2 ;;
        --pip-args) pip_args="$2"; pip_args_set=1; shift 2 ;;
        --no-start) start=0; shift ;;
        --prefix) prefix="$(mkdir -p "$2" && cd "$2" && pwd)"; start=0; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
if [ -n "$new_home" ] && [ -n "$token" ]; then
    echo "install.sh: --new-home and --token exclude each other" >&2; exit 2
fi
if [ -z "$prefix" ] && [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (sudo), or with --prefix DIR to install under DIR" >&2; exit 2
fi
if [ -z "$prefix" ] && [ ! -d /run/systemd/system ] && [ "$start" = 1 ]; then
    echo "install.sh: systemd is not running here; use --no-start (or --prefix DIR)" >&2; exit 2
fi

venv="${venv:-$prefix/opt/meshd}"
bin_link="$prefix/usr/local/bin/meshd"
home_dir="$prefix/var/lib/meshd"          # MESHD_HOME: state + model cache (the unit's StateDirectory=)
etc_dir="$prefix/etc/meshd"
config="$etc_dir/meshd.toml"
unit_dir="$prefix/etc/systemd/system"
doc_dir="$prefix/usr/share/doc/meshd"
step() { echo "[install] $*"; }

# Every meshd command runs as the service's user with the service's MESHD_HOME and
# config, so it reads and writes exactly what the daemon will.
as_meshd() {
    if [ -n "$prefix" ]; then
        (cd "$home_dir" && env MESHD_HOME="$home_dir" MESHD_CONFIG="$config" "$@")
    else
        (cd / && runuser -u meshd -- env MESHD_HOME="$home_dir" MESHD_CONFIG="$config" "$@")
    fi
}

# 1. meshd in its own virtual environment (torch: CPU build pinned by constraints.txt
#    from a checkout; on a GPU, install your torch into the venv first and pass --pip-args "")
if [ ! -x "$venv/bin/python" ]; then
    step "creating the virtual environment $venv"
    "$python" -m venv "$venv"
fi
if [ "$pip_args_set" = 0 ] && [ -d "$source_path" ] && [ -f "$source_path/constraints.txt" ]; then
    pip_args="-c $source_path/constraints.txt"
fi
step "installing meshd from $source_path"
# shellcheck disable=SC2086  # pip_args is a list of options
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet $pip_args "$source_path"
install -d "$(dirname "$bin_link")"
ln -sfn "$venv/bin/meshd" "$bin_link"
(cd / && "$venv/bin/python" - <<'PY'
from meshd.mesh.home_plan import default_profile, shipped_profiles_dir
assert default_profile() is not None, f"no reference profiles in {shipped_profiles_dir()}"
PY
)

# 2. the service's user; members of its group may use the API socket /run/meshd/meshd.sock
if [ -z "$prefix" ]; then
    if ! id -u meshd >/dev/null 2>&1; then
        step "creating the system user meshd"
        useradd --system --user-group --home-dir /var/lib/meshd --no-create-home \
                --shell /usr/sbin/nologin meshd
    fi
    if [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then
        usermod -aG meshd "$SUDO_USER"   # takes effect at the next login
    fi
    if [ "$gpu" = 1 ] && getent group video >/dev/null; then
        usermod -aG video meshd           # a Jetson's GPU device nodes
    fi
    install -d -o meshd -g meshd -m 0700 "$home_dir"
else
    install -d -m 0700 "$home_dir"
fi

# 3. settings (kept if present: edit them there)
install -d "$etc_dir"
if [ ! -f "$config" ]; then
    step "writing $config"
    {
        echo "# every key is optional; see \`meshd join --help\` (a flag's name, with _ for -)"
        if [ -n "$name" ]; then echo "name = \"$name\""; else echo "# name = \"kitchen-pc\"      # default: the host name"; fi
        [ -n "$model" ] && echo "model = \"$model\""
        [ -n "$http" ] && echo "http = \"$http\""
        echo "# interface = \"wlan0\"        # advertise over mDNS only here"
        echo "# memory_budget_mb = 4096    # what this device lends to the model"
        echo "# device = \"auto\"            # auto (a GPU the service can see), cpu, cuda, cuda:N"
    } > "$config"
    chmod 0644 "$config"
elif [ -n "$name$model$http" ]; then
    echo "[install] note: kept the existing $config; --name/--model/--http were not written to it" >&2
fi

# 4. the model, into the model cache under MESHD_HOME (where the daemon looks)
if [ -n "$model_from" ]; then
    step "copying models from $model_from"
    as_meshd install -d -m 0700 "$home_dir/models"
    for f in "$model_from"/*.gguf; do
        [ -e "$f" ] || { echo "install.sh: no *.gguf in $model_from" >&2; exit 1; }
        # cat as the service's user: the copy belongs to it, the original stays the caller's
        as_meshd sh -c 'cat > "$1.part" && mv "$1.part" "$1"' - "$home_dir/models/$(basename "$f")" < "$f"
    done
elif [ "$no_pull" = 0 ]; then
    step "pulling ${model:-the embedded default model}"
    as_meshd "$bin_link" model pull ${model:+"$model"}
fi

# 5. the home: create or join it (or check the state dir holds one), then exit
step "setting up the home in $home_dir"
join_args=(--setup-only)
[ -n "$new_home" ] && join_args+=(--new-home "$new_home")
[ -n "$token" ] && join_args+=(--token "$token")
as_meshd "$bin_link" join "${join_args[@]}" --log-format console

# 6. an API key, in the state dir the daemon reads
if [ -n "$key" ]; then
    step "creating the API key $key (shown once: store it in the client)"
    as_meshd "$bin_link" apikey create "$key"
fi

# 7. the unit, the GPU drop-in, the documentation
step "installing the unit into $unit_dir"
install -d "$unit_dir" "$doc_dir"
if [ -n "$prefix" ]; then  # point the unit at what was installed under the prefix
    sed -e "s#/usr/local/bin/meshd#$bin_link#g" -e "s#=/var/lib/meshd#=$home_dir#g" \
        "$here/meshd.service" > "$unit_dir/meshd.service"
    chmod 0644 "$unit_dir/meshd.service"
else
    install -m 0644 "$here/meshd.service" "$unit_dir/meshd.service"
fi
if [ "$gpu" = 1 ]; then
    install -d "$unit_dir/meshd.service.d"
    install -m 0644 "$here/meshd.service.d/gpu.conf" "$unit_dir/meshd.service.d/gpu.conf"
fi
install -m 0644 "$here/README.md" "$doc_dir/systemd.md"
if command -v systemd-analyze >/dev/null; then
    systemd-analyze verify "$unit_dir/meshd.service"
fi

# 8. start
if [ "$start" = 1 ]; then
    step "enabling and starting meshd (READY once it can answer; up to TimeoutStartSec=15min)"
    systemctl daemon-reload
    systemctl enable meshd
    systemctl restart meshd   # starts it, or restarts a running one on the new install
    echo "[install] done: systemctl status meshd; journalctl -u meshd -f -o cat"
else
    echo "[install] done; not started. To start: systemctl daemon-reload && systemctl enable --now meshd"
fi
