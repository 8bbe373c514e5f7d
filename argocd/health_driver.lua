-- Runs one Argo CD health script the way Argo CD does: the resource as the global `obj`, only the
-- base, table, string and math libraries in reach, and the script's returned table as the result.
-- Usage: lua5.1 health_driver.lua HEALTH_LUA OBJECT_LUA   (OBJECT_LUA returns the resource as a table)
-- Prints the status on the first line and the message (possibly empty) after it.
local script_path, object_path = arg[1], arg[2]

local function sandbox(globals)
  local env = {
    assert = assert, error = error, ipairs = ipairs, next = next, pairs = pairs, pcall = pcall,
    select = select, tonumber = tonumber, tostring = tostring, type = type, unpack = unpack,
    table = table, string = string, math = math,
  }
  for name, value in pairs(globals) do
    env[name] = value
  end
  return env
end

local function load_in(path, env)
  local chunk, load_error = loadfile(path)
  if chunk == nil then
    io.stderr:write(load_error, "\n")
    os.exit(2)
  end
  return setfenv(chunk, env)
end

local obj = load_in(object_path, {})()
local ok, result = pcall(load_in(script_path, sandbox({ obj = obj })))
if not ok then
  io.stderr:write("health script error: ", tostring(result), "\n")
  os.exit(3)
end
if type(result) ~= "table" or result.status == nil then
  io.stderr:write("health script returned no status\n")
  os.exit(4)
end
io.write(result.status, "\n", result.message or "")
