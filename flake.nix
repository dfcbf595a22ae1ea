{
  # The dev shell and `nix run .` for v4flash-pd. The Python stack is NOT rebuilt by Nix: the
  # shellHook materialises a venv from the same hash-locked stack.lock the image installs, so the
  # dev shell and the image cannot drift. Pins and the target Python are read from stack.toml /
  # stack.lock at evaluation time (never restated here); tests/env checks that this holds.
  description = "v4flash-pd: dev shell and launcher on the same stack.lock as the image";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-24.11";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" ];
      forAll = f: builtins.listToAttrs (map (system: { name = system; value = f system; }) systems);

      stack = builtins.fromTOML (builtins.readFile ./stack.toml);
      pythonVersion = stack.target.python;                       # "3.12"
      pythonAttr = "python" + builtins.replaceStrings [ "." ] [ "" ] pythonVersion;  # python312
      lockSha256 = builtins.hashFile "sha256" ./stack.lock;
      version = builtins.head (builtins.match ''.*__version__ = "([^"]+)".*''
        (builtins.readFile ./launcher/v4flash_pd/__init__.py));

      perSystem = system:
        let
          pkgs = import nixpkgs { inherit system; };
          python = pkgs.${pythonAttr};
          launcher = python.pkgs.buildPythonApplication {
            pname = "v4flash-pd";
            inherit version;
            src = ./.;
            pyproject = true;
            build-system = [ python.pkgs.setuptools ];
            dependencies = [ python.pkgs.click ];
            doCheck = false;
          };
        in
        {
          inherit launcher;
          shell = pkgs.mkShell {
            name = "v4flash-pd-dev";
            packages = [ python pkgs.uv pkgs.numactl pkgs.hadolint pkgs.podman pkgs.zstd pkgs.git ];
            V4FLASH_STACK_LOCK_SHA256 = lockSha256;
            # GPU driver libraries come from the host (see docs/environment.md: nix-gl-host on
            # non-NixOS hosts, /run/opengl-driver/lib on NixOS); nothing CUDA is built here.
            shellHook = ''
              export UV_NO_MANAGED_PYTHON=1
              if [ -d /run/opengl-driver/lib ]; then
                export LD_LIBRARY_PATH=/run/opengl-driver/lib''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
              fi
              export V4FLASH_PYTHON=${python}/bin/python${pythonVersion}
              ${pkgs.bash}/bin/bash ./tools/devshell-venv.sh \
                && [ -f "''${V4FLASH_VENV:-.venv}/.v4flash-stack-lock-sha256" ] \
                && . "''${V4FLASH_VENV:-.venv}/bin/activate"
            '';
          };
        };
    in
    {
      # Read by tests/env (consistency with stack.toml / stack.lock) and by humans.
      lib = { inherit pythonVersion pythonAttr lockSha256 version; stackPins = stack.pins; };

      packages = forAll (system: { default = (perSystem system).launcher; });
      apps = forAll (system: {
        default = { type = "app"; program = "${(perSystem system).launcher}/bin/v4flash-pd"; };
      });
      devShells = forAll (system: { default = (perSystem system).shell; });
    };
}
